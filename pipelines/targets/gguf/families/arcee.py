"""Arcee AFM (ArceeForCausalLM): llama.cpp arch `arcee`.

Llama's tensors and rope (adjacent pairs, so Q and K rows are permuted per head; Llama 3.1 frequency
scaling becomes the `rope_freqs` tensor, which llama.cpp's arcee applies), with a gate-less MLP:
up -> relu(x)^2 -> down. llama.cpp's arcee loads no attention output bias and no MLP biases, so
`attention_bias` and `mlp_bias` are refused, as is another activation.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, NORMS, RELU2_MLP, ROTARY_BUFFERS, VOCAB_AND_ROPE_DIMS, attention, llama3_rope_freqs
from .spec import Family, HParams, refuse_rope, refuse_true, require_activation


def _check(hp: HParams) -> None:
    refuse_true(hp, "arcee", "attention_bias", "llama.cpp's arcee has no attention output bias")
    refuse_true(hp, "arcee", "mlp_bias", "llama.cpp's arcee has no MLP biases")
    require_activation(hp, "arcee", "relu2", "llama.cpp's arcee runs a squared-ReLU MLP")
    refuse_rope(hp, "arcee", ("default", "linear", "yarn", "llama3"))


FAMILY = Family(
    name="arcee",
    gguf_arch="arcee",
    architectures=("ArceeForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention() + RELU2_MLP,
    params=VOCAB_AND_ROPE_DIMS,
    extra_tensors=llama3_rope_freqs,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
