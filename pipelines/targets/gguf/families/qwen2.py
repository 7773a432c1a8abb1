"""Qwen2 (Qwen2.5): the Llama tensor layout with q/k/v biases. llama.cpp runs `qwen2` with NEOX rope,
which rotates halves as HF does, so nothing is permuted."""

from __future__ import annotations

from ....errors import ModelFormatError
from .llama import EMBEDDINGS, NORMS, ROTARY_BUFFERS, SWIGLU, attention
from .spec import Family, HParams, IDENTITY


def _check(hp: HParams) -> None:
    if hp.rope["rope_type"] not in ("default", "linear", "yarn"):
        raise ModelFormatError(f"rope scaling type {hp.rope['rope_type']!r} is not supported for qwen2 GGUF yet")


FAMILY = Family(
    name="qwen2",
    gguf_arch="qwen2",
    architectures=("Qwen2ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + SWIGLU,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
