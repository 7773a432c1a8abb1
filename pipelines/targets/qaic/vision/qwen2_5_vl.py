"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): transformers' window-attention vision tower (full attention
in `fullatt_block_indexes`) and patch merger, a Qwen2 language model (q/k/v biases) with multimodal RoPE over
consecutive t/h/w sections of the frequencies (families/qwen2_5_vl.py). What the Qwen VLMs share (one fixed
image grid, pixel_values in the processor's flattened-patch layout, get_rope_index positions) is qwen_vl.py's.
"""

from __future__ import annotations

from .qwen_vl import qwen_vl_family

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
# (frames, patch rows, patch columns) of the one compiled image: 448 x 672 pixels at patch 14, whole 112-pixel
# attention windows, 16 x 24 = 384 image rows after the 2 x 2 merge
IMAGE_GRID_THW = (1, 32, 48)


def _model_class():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    return Qwen2_5_VLModel


FAMILY = qwen_vl_family(ARCHITECTURES, IMAGE_GRID_THW, "Qwen2_5_VLTextForVLM", _model_class)
