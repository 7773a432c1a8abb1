"""Llama and the models that share its layout (Mistral, CodeLlama, Vicuna, ...): llama.cpp arch `llama`.

Q and K rows (and their biases) are permuted per head from HF's rotary halves to llama.cpp's adjacent pairs
(`shared.permute_qk`); Llama 3.1's frequency scaling becomes a `rope_freqs` tensor. The rules are the shared
Llama layout (`shared.py`), which many other families reuse.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, NORMS, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention, llama3_rope_freqs
from .spec import Family

FAMILY = Family(
    name="llama",
    gguf_arch="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    tensors=EMBEDDINGS + NORMS + attention() + SWIGLU,
    params=VOCAB_AND_ROPE_DIMS,
    extra_tensors=llama3_rope_freqs,
    ignored=ROTARY_BUFFERS,
)
