"""The language model of Qwen2.5-VL (`Qwen2_5_VLTextModel`): Qwen2's layout (Llama's, q/k/v biases carried by
the projection modules) with multimodal RoPE over consecutive t/h/w sections of the frequencies
(`mrope_section`). Its text config (model_type qwen2_5_vl_text) has no causal LM in transformers, so the name
below is this export's own: the vision family (vision/qwen2_5_vl.py) sets it as the text config's
architecture, and it is a language model of VLMs only (families.LANGUAGE_SPECS), never a checkpoint's."""

from __future__ import annotations

from dataclasses import replace

from .blocks import MultimodalRope
from .llama import LLAMA

ARCHITECTURES = ("Qwen2_5_VLTextForVLM",)
FAMILY = replace(LLAMA, mrope=MultimodalRope(interleaved=False, default_section=(16, 24, 24)))
