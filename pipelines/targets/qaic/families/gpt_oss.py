"""GPT-OSS: Llama's names with attention sinks, a RoPE table of one frequency per pair of halves, and a MoE
routed TopK-then-softmax over experts with interleaved gate/up, biases and a clamped SwiGLU.

Sliding-window layers (config.layer_types) are masked as transformers masks them (p - j < window over the
full-length cache), so the export equals transformers below and beyond the window.
"""

from __future__ import annotations

from dataclasses import replace

from .blocks import GPT_OSS_EXPERTS, half_width_rotary_table, softmax_with_sinks, topk_softmax
from .llama import LLAMA
from .spec import Moe

ARCHITECTURES = ("GptOssForCausalLM",)
FAMILY = replace(LLAMA, rope_table=half_width_rotary_table, probs=softmax_with_sinks,
                 moe=Moe(router="router", scoring=topk_softmax, layout=GPT_OSS_EXPERTS))
