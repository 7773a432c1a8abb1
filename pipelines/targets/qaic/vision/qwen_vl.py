"""What the Qwen vision-language families share (Qwen2.5-VL, Qwen3-VL): transformers' vision tower over
flattened patches and its patch merger (spatial_merge_size^2 neighbouring patches -> one language-model row),
then a Qwen language model whose RoPE is multimodal (families/blocks.MultimodalRope): position_ids [4, batch,
seq], row 0 the text positions, rows 1-3 the temporal / height / width positions transformers' `get_rope_index`
gives the prompt.

A family's vision graph serves ONE image size, a constant of its declaration (`grid`, in patches): the grid is
a constant of the trace (window order, attention splits, interpolated position embeddings), not an input, so
`pixel_values` [patches, channels * temporal_patch * patch * patch] - the processor's flattened layout - is the
vision graph's only input. An image of another size is resized to this one before the processor (the serving
side's job, as for LLaVA's fixed image_size).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .spec import VisionFamily, config_value, pixels

if TYPE_CHECKING:  # numpy loads where an image is made or run, not when the families are read
    import numpy as np


def qwen_vl_family(architectures: tuple[str, ...], grid: tuple[int, int, int], language_architecture: str,
                   model_class: Callable[[], Any], deepstack: bool = False, single_qpc: bool = True) -> VisionFamily:
    """The VisionFamily of a Qwen VLM: `grid` (frames, patch rows, patch columns) of the one compiled image;
    `language_architecture` the decoder family of its language model (families/, a VLM-only name);
    `model_class()` transformers' `*VLModel` class, whose get_rope_index gives the positions; `deepstack`: the
    tower also returns DeepStack features (Qwen3-VL), added to the first decoder layers' image rows; `single_qpc`:
    QEfficient also compiles it as one QPC (vision/single.py keeps DeepStack there, where QEfficient drops it)."""

    def thw():
        import numpy as np

        return np.asarray([grid], dtype=np.int64)

    def patch_width(config: Any) -> int:
        vc = config.vision_config
        return int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2

    def vision_size(config: Any) -> int:
        t, h, w = grid
        merge = int(config.vision_config.spatial_merge_size)
        if h % merge or w % merge:
            raise ValueError(f"the image grid {grid} does not merge by {merge}")
        return t * (h // merge) * (w // merge)

    def vision_module(model):
        return _QwenVision(model, thw(), deepstack)

    def vision_inputs(config: Any, seed: int) -> dict[str, np.ndarray]:
        return {"pixel_values": pixels((math.prod(grid), patch_width(config)), seed)}

    def language_model(model) -> tuple[Any, Any, Any]:
        """The text config under this export's name for its decoder family (transformers has no causal LM for a
        Qwen VLM's text model type), the text model, the lm_head."""
        import copy

        cfg = copy.copy(model.config.get_text_config())
        cfg.architectures = [language_architecture]
        return cfg, model.model.language_model, model.lm_head

    def image_token(config: Any) -> int:
        return int(config_value(config, "image_token_id"))

    def token_types(config: Any, ids: np.ndarray) -> dict[str, np.ndarray]:
        """transformers computes M-RoPE positions only when told which tokens are image rows (1) or text (0)."""
        import numpy as np

        return {"mm_token_type_ids": (np.asarray(ids) == image_token(config)).astype(np.int64)}

    def positions(config: Any, prompt: list[int], inputs: dict[str, np.ndarray]) -> np.ndarray:
        """[4, 1, seq]: the text positions (cache slot, mask), then transformers' own t/h/w rows for the prompt."""
        import numpy as np

        ids = np.asarray([prompt], dtype=np.int64)
        rope = rope_index(model_class(), config, ids, token_types(config, ids)["mm_token_type_ids"], thw())
        text = np.arange(len(prompt), dtype=np.int64).reshape(1, 1, -1)
        return np.concatenate([text, rope], axis=0)

    def vision_symbols(config: Any) -> dict[str, str]:
        return {"batch_size": "1", "grid_height": str(math.prod(grid)), "grid_width": str(patch_width(config))}

    return VisionFamily(
        architectures=architectures,
        vision_module=vision_module,
        vision_inputs=vision_inputs,
        vision_size=vision_size,
        image_token_id=image_token,
        language_model=language_model,
        reference_kwargs=lambda config, inputs: {"pixel_values": inputs["pixel_values"], "image_grid_thw": thw()},
        vision_symbols=vision_symbols,
        vision_axes={"pixel_values": {0: "grid_height", 1: "grid_width"}},  # QEfficient's symbol names
        positions=positions,
        reference_token_kwargs=token_types,
        deepstack=(lambda config: len(config.vision_config.deepstack_visual_indexes)) if deepstack else None,
        single_qpc=single_qpc,
    )


def rope_index(model_class, config: Any, ids: np.ndarray, token_types: np.ndarray, thw: np.ndarray) -> np.ndarray:
    """transformers' `get_rope_index` of `model_class` for one prompt: [3, 1, seq] t/h/w positions. It reads only
    `self.config` and `self.get_vision_position_ids` (which reads nothing of self), so no model is built."""
    import types

    import numpy as np
    import torch

    owner = types.SimpleNamespace(config=config)
    owner.get_vision_position_ids = lambda *a, **k: model_class.get_vision_position_ids(owner, *a, **k)
    with torch.no_grad():
        rope, _deltas = model_class.get_rope_index(owner, torch.from_numpy(ids), torch.from_numpy(token_types),
                                                   image_grid_thw=torch.from_numpy(thw))
    return rope.numpy().astype(np.int64)


def _QwenVision(model, thw: np.ndarray, deepstack: bool):  # noqa: N802 - a factory named for the class it builds
    """pixel_values [patches, patch_width] -> vision_embeds [1, merged rows, hidden] (and with `deepstack`
    deepstack_features [levels, 1, merged rows, hidden]) for the family's one grid."""
    import torch

    class QwenVision(torch.nn.Module):
        def __init__(self, vlm):
            super().__init__()
            self.visual = vlm.model.visual
            self.register_buffer("grid_thw", torch.from_numpy(thw), persistent=False)

        def forward(self, pixel_values):
            out = self.visual(pixel_values, grid_thw=self.grid_thw)
            embeds = out.pooler_output.unsqueeze(0)
            if not deepstack:
                return embeds
            return embeds, torch.stack(list(out.deepstack_features)).unsqueeze(1)

    return QwenVision(model).eval()
