"""InternVL (transformers' native InternVLForConditionalGeneration, the "-hf" checkpoints; never the remote-code
InternVLChatModel): an InternVLVisionModel tower over square tiles of `image_size`, its selected hidden states
(CLS dropped under "default") pixel-shuffled by `downsample_ratio`, then the multi_modal_projector; a Qwen2 (or
Llama) decoder reads the rows over its `image_token_id` placeholders (the `<IMG_CONTEXT>` tokens the processor
writes between `<img>` and `</img>`).

The processor cuts an image into up to `max_patches` tiles plus a thumbnail, so the tiles are the batch of the
vision tower: pixel_values [tiles, 3, side, side], every tile giving (side / patch * downsample_ratio)^2 rows (256
at 448 / 14 / 0.5). As QEfficient, the graph is compiled for a fixed tile count (`NUM_PATCHES`, QEfficient's
default 13 = 12 tiles + thumbnail: the host pads or resizes to it) and returns all tiles' rows as one image,
vision_embeds [1, tiles x rows, hidden], so an image spans prefill chunks through image_idx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import VisionFamily, config_value, image_features_module, pixels

if TYPE_CHECKING:  # numpy loads where an image is made or run, not when the families are read
    import numpy as np

ARCHITECTURES = ("InternVLForConditionalGeneration",)
NUM_PATCHES = 13  # tiles per image the vision graph is compiled for (QEfficient's INTERN_NUM_PATCHES)


def _side(config: Any) -> int:
    size = config_value(config.vision_config, "image_size")
    size = size if isinstance(size, (list, tuple)) else (size, size)
    if size[0] != size[1]:
        from ....core.errors import ModelFormatError

        raise ModelFormatError(f"InternVL tiles are square; this vision config's image_size is {tuple(size)}")
    return int(size[0])


def _rows_per_tile(config: Any) -> int:
    patch = config.vision_config.patch_size
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return int((_side(config) // int(patch) * float(config.downsample_ratio)) ** 2)


def _vision_module(model):
    # the tiles' rows in order, as one image: transformers' masked_scatter reads them so
    return image_features_module(model, lambda feats: feats.reshape(1, -1, feats.shape[-1]))


def _vision_inputs(config: Any, seed: int) -> dict[str, np.ndarray]:
    side = _side(config)
    return {"pixel_values": pixels((NUM_PATCHES, 3, side, side), seed)}


FAMILY = VisionFamily(
    architectures=ARCHITECTURES,
    vision_module=_vision_module,
    vision_inputs=_vision_inputs,
    vision_size=lambda config: NUM_PATCHES * _rows_per_tile(config),
    # QEfficient's Vision specialization also sets num_patches, which is no axis of this graph (batched_num_patches
    # is the tiles of all images of the batch: one image here)
    vision_symbols=lambda config: {"batch_size": "1", "batched_num_patches": str(NUM_PATCHES),
                                   "img_size": str(_side(config))},
    vision_axes={"pixel_values": {0: "batched_num_patches", 2: "img_size", 3: "img_size"}},
)
