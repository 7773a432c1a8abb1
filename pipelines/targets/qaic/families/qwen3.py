"""Qwen3: Llama's layout with q_norm / k_norm over each head's dims before RoPE."""

from __future__ import annotations

from dataclasses import replace

from .blocks import PerHeadQkNorm
from .llama import LLAMA

ARCHITECTURES = ("Qwen3ForCausalLM",)
FAMILY = replace(LLAMA, qk_norm=PerHeadQkNorm())
