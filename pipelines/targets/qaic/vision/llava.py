"""LLaVA-1.5 (LlavaForConditionalGeneration): a CLIP vision tower, the hidden states of
`vision_feature_layer` (the CLS row dropped under the "default" strategy), a two-layer projector; the image
rows replace the `image_token_index` placeholders of a Llama (or any transformers causal LM) decoder.
One image of `image_size` pixels square gives (image_size / patch_size)^2 rows (576 at 336 / 14).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import VisionFamily, config_value, image_features_module, pixels

if TYPE_CHECKING:  # numpy loads where an image is made or run, not when the families are read
    import numpy as np

ARCHITECTURES = ("LlavaForConditionalGeneration",)


def _vision_module(model):
    import torch

    return image_features_module(model, lambda feats: torch.stack(list(feats)))  # [images, rows, hidden]


def _image_side(config: Any) -> int:
    return int(config_value(config.vision_config, "image_size"))


def _vision_inputs(config: Any, seed: int) -> dict[str, np.ndarray]:
    side = _image_side(config)
    return {"pixel_values": pixels((1, 3, side, side), seed)}


def _vision_size(config: Any) -> int:
    rows = (_image_side(config) // int(config.vision_config.patch_size)) ** 2
    return rows + (1 if config.vision_feature_select_strategy == "full" else 0)


FAMILY = VisionFamily(
    architectures=ARCHITECTURES,
    vision_module=_vision_module,
    vision_inputs=_vision_inputs,
    vision_size=_vision_size,
    vision_symbols=lambda config: {"batch_size": "1", "img_size": str(_image_side(config))},
    vision_axes={"pixel_values": {0: "batch_size", 2: "img_size", 3: "img_size"}},
)
