"""Starcoder2: Llama's attention (separate q/k/v/o projections, RoPE from the model's rotary_emb, grouped KV
heads) with GPT-2's feed-forward: LayerNorms with biases, a plain MLP c_fc -> act -> c_proj, and biases on
every projection (config.use_bias). config.sliding_window, when set, applies to every layer and is masked as
transformers masks it."""

from __future__ import annotations

from dataclasses import replace

from .blocks import layer_norm
from .gpt2 import GPT2_MLP
from .llama import LLAMA

ARCHITECTURES = ("Starcoder2ForCausalLM",)
FAMILY = replace(LLAMA, norm=layer_norm, mlp=GPT2_MLP)
