"""LLaVA-NeXT (LlavaNextForConditionalGeneration; IBM's Granite Vision is one): "anyres" images. The processor
resizes an image to the best of the config's `image_grid_pinpoints`, cuts it into tiles of the vision tower's
`image_size` and adds the whole image resized as a base tile: pixel_values [images, num_patches, 3, side, side]
beside `image_sizes` (the original height, width). transformers then packs the tiles' features into one grid,
trims the padding the resize added (`unpad_image`) and ends every grid row with the learned `image_newline`; the
base tile's rows come first. So the image rows depend on the image size.

An AOT graph has one shape, so the family declares the image size it is compiled for (`IMAGE_SIZE`,
QEfficient's Granite Vision resolution, height 1109 x width 1610): the host resizes every image to it, and the
tile grid, the trim and so `vision_size` follow from the config (1 + 3 x 3 tiles of 384 and 5239 rows for
granite-vision-3.2). The vision graph takes pixel_values alone: image_sizes is that constant, so the packing is
fixed index arithmetic, traced once, batch-generic (transformers' own pack loops over images in Python).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import VisionFamily, config_value, pixels

if TYPE_CHECKING:  # numpy loads where an image is made or run, not when the families are read
    import numpy as np

ARCHITECTURES = ("LlavaNextForConditionalGeneration",)
IMAGE_SIZE = (1109, 1610)  # (height, width) every image is resized to before tiling: the compiled resolution


def _side(config: Any) -> int:
    return int(config_value(config.vision_config, "image_size"))


def _layout(config: Any) -> dict[str, int]:
    """The fixed anyres layout of IMAGE_SIZE, by transformers' own functions: tiles (rows x cols of the grid,
    num_patches with the base tile), the per-tile feature side, and the window unpad_image keeps of the packed grid."""
    import torch
    from transformers.models.llava_next.modeling_llava_next import (
        get_anyres_image_grid_shape,
        image_size_to_num_patches,
        unpad_image,
    )

    side = _side(config)
    pinpoints = [list(p) for p in config.image_grid_pinpoints]
    grid_h, grid_w = get_anyres_image_grid_shape(list(IMAGE_SIZE), pinpoints, side)
    num_patches = image_size_to_num_patches(list(IMAGE_SIZE), pinpoints, side)
    if num_patches != grid_h * grid_w + 1:
        from ....core.errors import ModelFormatError

        raise ModelFormatError(f"image_grid_pinpoints are not multiples of the tile size {side}: the anyres grid "
                               f"{grid_h}x{grid_w} does not give {num_patches} patches")
    feat = side // int(config.vision_config.patch_size)
    height, width = grid_h * feat, grid_w * feat
    # the kept window as flat indices of the packed grid: unpad_image is transformers' trim, applied to positions
    kept = unpad_image(torch.arange(height * width).view(1, height, width), list(IMAGE_SIZE))[0]
    first = int(kept[0, 0])
    return {"grid_h": grid_h, "grid_w": grid_w, "num_patches": num_patches, "feat": feat,
            "row0": first // width, "col0": first % width, "rows": int(kept.shape[0]), "cols": int(kept.shape[1])}


def _vision_module(model):
    import torch

    class LlavaNextVision(torch.nn.Module):
        """transformers' get_image_features + pack_image_features for the fixed IMAGE_SIZE, over a batch of images:
        the tower's selected hidden states (CLS dropped under "default"), the projector, the base tile's rows,
        then the tiles' grid row by row (trimmed), each grid row closed by image_newline."""

        def __init__(self, vlm):
            super().__init__()
            inner, cfg = vlm.model, vlm.config
            self.tower, self.projector, self.newline = inner.vision_tower, inner.multi_modal_projector, inner.image_newline
            self.layer, self.strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
            self.lay = _layout(cfg)

        def forward(self, pixel_values):
            lay, hidden = self.lay, self.newline.shape[0]
            n, side = lay["num_patches"], pixel_values.shape[-1]
            states = self.tower(pixel_values.reshape(-1, 3, side, side), output_hidden_states=True).hidden_states
            if isinstance(self.layer, int):
                selected = states[self.layer]
            else:  # several layers: their hidden states side by side, as transformers concatenates them
                selected = torch.cat([states[i] for i in self.layer], dim=-1)
            if self.strategy == "default":
                selected = selected[:, 1:]
            feats = self.projector(selected).reshape(-1, n, lay["feat"] * lay["feat"], hidden)
            base, f = feats[:, 0], lay["feat"]
            # tiles [images, grid_h, grid_w, f, f, hidden] -> one grid [images, grid_h*f, grid_w*f, hidden]
            grid = feats[:, 1:].reshape(-1, lay["grid_h"], lay["grid_w"], f, f, hidden).permute(0, 1, 3, 2, 4, 5)
            grid = grid.reshape(-1, lay["grid_h"] * f, lay["grid_w"] * f, hidden)
            grid = grid[:, lay["row0"]:lay["row0"] + lay["rows"], lay["col0"]:lay["col0"] + lay["cols"]]
            newline = self.newline.reshape(1, 1, 1, hidden).expand(grid.shape[0], lay["rows"], 1, hidden)
            grid = torch.cat((grid, newline), dim=2).reshape(-1, lay["rows"] * (lay["cols"] + 1), hidden)
            return torch.cat((base, grid), dim=1)  # [images, vision_size, hidden]

    return LlavaNextVision(model).eval()


def _vision_inputs(config: Any, seed: int) -> dict[str, np.ndarray]:
    side = _side(config)
    return {"pixel_values": pixels((1, _layout(config)["num_patches"], 3, side, side), seed)}


def _vision_size(config: Any) -> int:
    lay = _layout(config)
    return lay["feat"] ** 2 + lay["rows"] * (lay["cols"] + 1)


def _reference_kwargs(config: Any, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    import numpy as np
    images = inputs["pixel_values"].shape[0]
    return {"pixel_values": inputs["pixel_values"], "image_sizes": np.asarray([IMAGE_SIZE] * images, dtype=np.int64)}


def _vision_symbols(config: Any) -> dict[str, str]:
    # QEfficient's Vision specialization also names image_size_height / image_size_width; here they are the
    # module's IMAGE_SIZE, not an axis of the graph (which has no image_sizes input), so they are not symbols
    return {"batch_size": "1", "num_patches": str(_layout(config)["num_patches"]), "img_size": str(_side(config))}


FAMILY = VisionFamily(
    architectures=ARCHITECTURES,
    vision_module=_vision_module,
    vision_inputs=_vision_inputs,
    vision_size=_vision_size,
    reference_kwargs=_reference_kwargs,
    vision_symbols=_vision_symbols,
    vision_axes={"pixel_values": {0: "batch_size", 1: "num_patches", 3: "img_size", 4: "img_size"}},
    single_qpc=False,  # QEfficient: Granite Vision is dual QPC only
)
