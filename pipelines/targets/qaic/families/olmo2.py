"""OLMo 2: norms after attention and after the MLP (none before them), and q_norm / k_norm over the whole q
and k projections. Its `post_attention_layernorm` normalizes the attention output (Llama's the MLP input)."""

from __future__ import annotations

from dataclasses import replace

from .blocks import ProjectionQkNorm
from .llama import LLAMA
from .spec import Norms

ARCHITECTURES = ("Olmo2ForCausalLM",)
FAMILY = replace(LLAMA, qk_norm=ProjectionQkNorm(),
                 norms=Norms(pre_attn=None, post_attn="post_attention_layernorm", pre_mlp=None,
                             post_mlp="post_feedforward_layernorm"))
