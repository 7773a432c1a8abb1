"""The language model of Qwen3-VL-MoE (`Qwen3VLMoeTextModel`): Qwen3-MoE's layout (per-head q/k norms, stacked
experts behind a softmax top-k router) whose top-k weights are always renormalized (its router has no
norm_topk_prob), with Qwen3-VL's interleaved multimodal RoPE. A language model of VLMs only, like qwen3_vl."""

from __future__ import annotations

from dataclasses import replace

from .qwen3_moe import FAMILY as QWEN3_MOE
from .qwen3_vl import FAMILY as QWEN3_VL
from .spec import Moe

ARCHITECTURES = ("Qwen3VLMoeTextForVLM",)
FAMILY = replace(QWEN3_MOE, moe=Moe(normalize=True), mrope=QWEN3_VL.mrope)
