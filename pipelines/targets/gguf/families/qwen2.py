"""Qwen2 (Qwen2.5): the Llama tensor layout with q/k/v biases. llama.cpp runs `qwen2` with NEOX rope,
which rotates halves as HF does, so nothing is permuted."""

from __future__ import annotations

from .shared import EMBEDDINGS, NORMS, ROTARY_BUFFERS, SWIGLU, attention
from .spec import IDENTITY, Family, HParams, refuse_rope


def _check(hp: HParams) -> None:
    refuse_rope(hp, "qwen2")


FAMILY = Family(
    name="qwen2",
    gguf_arch="qwen2",
    architectures=("Qwen2ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + SWIGLU,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
