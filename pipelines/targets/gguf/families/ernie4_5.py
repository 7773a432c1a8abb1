"""ERNIE 4.5 dense (Ernie4_5ForCausalLM, the 0.3B): llama.cpp arch `ernie4_5`.

Llama's tensor names and block, tied embeddings by default, and head_dim as its own setting (128 with
hidden 1024 / 16 heads), written as the key/value length. Its rope already rotates adjacent pairs
(transformers' Ernie 4.5 interleaves cos/sin and rotates (x0, x1), (x2, x3), ...), which is llama.cpp's
normal rope, so unlike Llama nothing is permuted. llama.cpp's ernie4_5 applies no attention output or MLP
biases and no rope factor tensor: `use_bias` and llama3 rope scaling are refused.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, NORMS, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention
from .spec import IDENTITY, Family, HParams, refuse_rope, refuse_true, require_activation


def _check(hp: HParams) -> None:
    refuse_true(hp, "ernie4_5", "use_bias", "llama.cpp's ernie4_5 has no attention output or MLP biases")
    refuse_rope(hp, "ernie4_5")
    require_activation(hp, "ernie4_5", "silu", "llama.cpp's ernie4_5 runs a SiLU-gated MLP")


FAMILY = Family(
    name="ernie4_5",
    gguf_arch="ernie4_5",
    architectures=("Ernie4_5ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + SWIGLU,
    params=VOCAB_AND_ROPE_DIMS,
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_default=True,  # Ernie4_5Config's tie_word_embeddings default
)
