"""The language model of Qwen3-VL (`Qwen3VLTextModel`): Qwen3's layout (per-head q/k norms) with multimodal RoPE
whose t/h/w rows interleave over the first 3 * section frequencies (`mrope_section`, the rest temporal). Its
DeepStack additions (vision features added to the first layers' image rows) are the VLM decoder's
(decoder.deepstack), fed by the vision family (vision/qwen3_vl.py). The name below is this export's own, set by
the vision family on the text config: a language model of VLMs only (families.LANGUAGE_SPECS)."""

from __future__ import annotations

from dataclasses import replace

from .blocks import MultimodalRope
from .qwen3 import FAMILY as QWEN3

ARCHITECTURES = ("Qwen3VLTextForVLM",)
FAMILY = replace(QWEN3, mrope=MultimodalRope(interleaved=True, default_section=(24, 20, 20)))
