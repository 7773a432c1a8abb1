"""Qwen3 (dense): Qwen2's layout without q/k/v biases, plus per-head RMS norms of queries and keys
(`q_norm`/`k_norm`, [head_dim]) before the rope: llama.cpp arch `qwen3`. Its rope is NEOX (halves, as HF
stores them), so nothing is permuted and the norms apply to the heads as they are. head_dim is its own
setting (Qwen3-4B: 128 with hidden 2560 / 32 heads) and is written as the key/value length.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, NORMS, QK_NORMS, ROTARY_BUFFERS, SWIGLU, attention
from .spec import IDENTITY, Family, HParams, refuse_rope


def _check(hp: HParams) -> None:
    refuse_rope(hp, "qwen3")


FAMILY = Family(
    name="qwen3",
    gguf_arch="qwen3",
    architectures=("Qwen3ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + QK_NORMS + SWIGLU,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
