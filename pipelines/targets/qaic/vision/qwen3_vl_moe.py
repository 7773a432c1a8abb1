"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration): Qwen3-VL's vision tower and DeepStack (qwen3_vl.py), the
same fixed image grid, and a Qwen3-MoE language model with interleaved multimodal RoPE
(families/qwen3_vl_moe.py)."""

from __future__ import annotations

from .qwen3_vl import IMAGE_GRID_THW
from .qwen_vl import qwen_vl_family

ARCHITECTURES = ("Qwen3VLMoeForConditionalGeneration",)


def _model_class():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

    return Qwen3VLMoeModel


# QEfficient has no single-QPC forward for the MoE (reference/ai100-qpc.md): dual only
FAMILY = qwen_vl_family(ARCHITECTURES, IMAGE_GRID_THW, "Qwen3VLMoeTextForVLM", _model_class, deepstack=True,
                        single_qpc=False)
