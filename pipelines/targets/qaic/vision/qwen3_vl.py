"""Qwen3-VL (Qwen3VLForConditionalGeneration): transformers' vision tower (full attention, learned position
embeddings interpolated to the grid), its patch merger and its DeepStack mergers (the hidden states of
`deepstack_visual_indexes`, each merged to the image rows and added to the image rows after the first decoder
layers: the vision graph's second output, layout.DEEPSTACK), a Qwen3 language model with interleaved
multimodal RoPE (families/qwen3_vl.py). What the Qwen VLMs share (one fixed image grid, pixel_values in the
processor's flattened-patch layout, get_rope_index positions) is qwen_vl.py's.
"""

from __future__ import annotations

from .qwen_vl import qwen_vl_family

ARCHITECTURES = ("Qwen3VLForConditionalGeneration",)
# (frames, patch rows, patch columns) of the one compiled image: 448 x 672 pixels at patch 16, 14 x 21 = 294
# image rows after the 2 x 2 merge
IMAGE_GRID_THW = (1, 28, 42)


def _model_class():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return Qwen3VLModel


FAMILY = qwen_vl_family(ARCHITECTURES, IMAGE_GRID_THW, "Qwen3VLTextForVLM", _model_class, deepstack=True)
