"""Gemma: Llama's layout with (1 + w) RMSNorms; its embedding module scales by sqrt(hidden) itself."""

from __future__ import annotations

from dataclasses import replace

from .blocks import rms_norm_1p
from .llama import LLAMA

ARCHITECTURES = ("GemmaForCausalLM",)
FAMILY = replace(LLAMA, norm=rms_norm_1p)
