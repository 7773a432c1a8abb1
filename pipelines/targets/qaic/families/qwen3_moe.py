"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with Mixtral's MoE, renormalized only when the config
sets norm_topk_prob; layers listed in mlp_only_layers keep a dense MLP (no `experts` module)."""

from __future__ import annotations

from dataclasses import replace

from .blocks import PerHeadQkNorm
from .llama import LLAMA
from .spec import Moe

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
FAMILY = replace(LLAMA, qk_norm=PerHeadQkNorm(), moe=Moe(normalize="norm_topk_prob"))
