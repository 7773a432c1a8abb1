"""Mixtral: Llama's attention with a sparse MoE in every layer (softmax over the experts, TopK, the top-k
weights always renormalized; stacked experts)."""

from __future__ import annotations

from dataclasses import replace

from .llama import LLAMA
from .spec import Moe

ARCHITECTURES = ("MixtralForCausalLM",)
FAMILY = replace(LLAMA, moe=Moe())
