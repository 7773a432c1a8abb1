"""Gemma 2: Gemma's norms, plus a norm after attention and around the MLP, and soft-capped attention scores
and logits.

The sliding window is disabled (full attention in every layer, as vLLM serves Gemma 2 on AI 100): equal to
transformers while sequences stay shorter than config.sliding_window.
"""

from __future__ import annotations

from dataclasses import replace

from .blocks import rms_norm_1p
from .llama import LLAMA
from .spec import Norms

ARCHITECTURES = ("Gemma2ForCausalLM",)
FAMILY = replace(LLAMA, norm=rms_norm_1p, sliding=False, attn_softcap="attn_logit_softcapping",
                 final_softcap="final_logit_softcapping",
                 norms=Norms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                             "post_feedforward_layernorm"))
