"""Phi-3: Llama's layout with one fused qkv_proj ([q | k | v]) and one fused gate_up_proj (gate first);
partial rotary and LongRoPE come from the model's own rotary_emb."""

from __future__ import annotations

from dataclasses import replace

from .blocks import FusedGatedMlp, SplitQkv
from .llama import LLAMA

ARCHITECTURES = ("Phi3ForCausalLM",)
FAMILY = replace(LLAMA, qkv=SplitQkv("qkv_proj"), mlp=FusedGatedMlp("gate_up_proj", "down_proj", "activation_fn"))
