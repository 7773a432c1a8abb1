"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): transformers' own vision tower (a window-attention ViT over
flattened patches, full attention in `fullatt_block_indexes`) and its patch merger (spatial_merge_size^2
neighbouring patches -> one language-model row), then a Qwen2 language model whose RoPE is multimodal
(families/qwen2_5_vl.py): position_ids [4, batch, seq], row 0 the text positions, rows 1-3 the temporal /
height / width positions transformers' `get_rope_index` gives the prompt.

The vision graph serves ONE image size, a constant of this family (`IMAGE_GRID_THW`, in patches: 448 x 672
pixels at patch 14, whole 112-pixel attention windows): the grid is a constant of the trace (the window order,
the per-window attention splits), not an input, so `pixel_values` [patches, channels * temporal_patch * patch
* patch] - the processor's flattened layout - is the vision graph's only input. An image of another size is
resized to this one before the processor (the serving side's job, as for LLaVA's fixed image_size).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .spec import VisionFamily, config_value, pixels

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
IMAGE_GRID_THW = (1, 32, 48)  # (frames, patch rows, patch columns) of the one compiled image
LANGUAGE_ARCHITECTURE = "Qwen2_5_VLTextForVLM"  # families/qwen2_5_vl.py: the language model's decoder family


def _grid() -> np.ndarray:
    return np.asarray([IMAGE_GRID_THW], dtype=np.int64)


def _patch_width(config: Any) -> int:
    vc = config.vision_config
    return int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2


def _vision_size(config: Any) -> int:
    t, h, w = IMAGE_GRID_THW
    merge = int(config.vision_config.spatial_merge_size)
    if h % merge or w % merge:
        raise ValueError(f"the image grid {IMAGE_GRID_THW} does not merge by {merge}")
    return t * (h // merge) * (w // merge)


def _vision_module(model):
    import torch

    class QwenVision(torch.nn.Module):
        """pixel_values [patches, patch_width] -> [1, merged rows, hidden], for the family's one grid."""

        def __init__(self, vlm):
            super().__init__()
            self.visual = vlm.model.visual
            self.register_buffer("grid_thw", torch.from_numpy(_grid()), persistent=False)

        def forward(self, pixel_values):
            return self.visual(pixel_values, grid_thw=self.grid_thw).pooler_output.unsqueeze(0)

    return QwenVision(model).eval()


def _vision_inputs(config: Any, seed: int) -> dict[str, np.ndarray]:
    t, h, w = IMAGE_GRID_THW
    return {"pixel_values": pixels((t * h * w, _patch_width(config)), seed)}


def _language_model(model) -> tuple[Any, Any, Any]:
    """The text config under this export's name for its decoder family (transformers has no causal LM for
    qwen2_5_vl_text), the text model, the lm_head."""
    import copy

    cfg = copy.copy(model.config.get_text_config())
    cfg.architectures = [LANGUAGE_ARCHITECTURE]
    return cfg, model.model.language_model, model.lm_head


def _image_token(config: Any) -> int:
    return int(config_value(config, "image_token_id"))


def _token_types(config: Any, ids: np.ndarray) -> dict[str, np.ndarray]:
    """transformers computes the M-RoPE positions only when told which tokens are image rows (1) or text (0)."""
    return {"mm_token_type_ids": (np.asarray(ids) == _image_token(config)).astype(np.int64)}


def _positions(config: Any, prompt: list[int], inputs: dict[str, np.ndarray]) -> np.ndarray:
    """[4, 1, seq]: the text positions (cache slot, mask), then transformers' own t/h/w rows for the prompt."""
    import types

    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    ids = np.asarray([prompt], dtype=np.int64)
    # get_rope_index reads only self.config and self.get_vision_position_ids (which reads nothing of self)
    owner = types.SimpleNamespace(config=config)
    owner.get_vision_position_ids = lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(owner, *a, **k)
    with torch.no_grad():
        rope, _deltas = Qwen2_5_VLModel.get_rope_index(
            owner, torch.from_numpy(ids), torch.from_numpy(_token_types(config, ids)["mm_token_type_ids"]),
            image_grid_thw=torch.from_numpy(_grid()))
    text = np.arange(len(prompt), dtype=np.int64).reshape(1, 1, -1)
    return np.concatenate([text, rope.numpy().astype(np.int64)], axis=0)


def _vision_symbols(config: Any) -> dict[str, str]:
    t, h, w = IMAGE_GRID_THW
    return {"batch_size": "1", "grid_height": str(t * h * w), "grid_width": str(_patch_width(config))}


FAMILY = VisionFamily(
    architectures=ARCHITECTURES,
    vision_module=_vision_module,
    vision_inputs=_vision_inputs,
    vision_size=_vision_size,
    image_token_id=_image_token,
    language_model=_language_model,
    reference_kwargs=lambda config, inputs: {"pixel_values": inputs["pixel_values"], "image_grid_thw": _grid()},
    vision_symbols=_vision_symbols,
    vision_axes={"pixel_values": {0: "grid_height", 1: "grid_width"}},  # QEfficient's symbol names
    positions=_positions,
    reference_token_kwargs=_token_types,
)
