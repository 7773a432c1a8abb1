"""GPTBigCode (StarCoder): GPT-2's layout; its fused c_attn is [q | k | v] with one KV head when the config
says multi_query, else GPT-2-era [head][q, k, v] with as many KV heads as query heads."""

from __future__ import annotations

from typing import Any

from .blocks import PerHeadQkv, SplitQkv
from .gpt2 import GPT2_MLP, GPT2_NAMES
from .spec import Family

ARCHITECTURES = ("GPTBigCodeForCausalLM",)


def FAMILY(cfg: Any) -> Family:  # noqa: N802 -- a declaration that depends on the config
    multi_query = bool(cfg.multi_query)
    return Family(**GPT2_NAMES, positions="wpe", rotary=None, mlp=GPT2_MLP,
                  qkv=SplitQkv("c_attn") if multi_query else PerHeadQkv("c_attn"),
                  kv_heads=1 if multi_query else cfg.num_attention_heads)
