"""Llama 3.2 Vision (MllamaForConditionalGeneration) in QEfficient's dual-QPC form: the image is not merged as
rows; the language model's cross-attention layers (text_config.cross_attention_layers) read it as K/V.

- vision graph: transformers' MllamaVisionModel (tiles, aspect-ratio embeddings, local and global encoders,
  intermediate layers concatenated), the multi_modal_projector, then each cross layer's k_proj, v_proj and
  k_norm: outputs `past_key.{i}` / `past_value.{i}` [batch, n_kv, tiles * rows_per_tile, head_dim], the K/V
  transformers caches for that layer; rows_per_tile = (image_size / patch_size)^2 + 1 (the class row; the
  vision model's padding to a multiple of 8 is already cut off);
- language graph: the retained-state decoder of MllamaTextModel (families/mllama.py) with those K/V as the cross
  layers' retained state and `cross_attention_mask` [batch, seq_len, images, tiles] beside the text inputs;
- the prompt holds ONE `<|image|>` token (image_token_index) per image; tokens before it see no image.

The compiled tile layout: one image of `max_num_tiles` tiles of `image_size` pixels (inputs pixel_values
[batch, images, tiles, 3, side, side], aspect_ratio_ids [batch, images], aspect_ratio_mask [batch, images,
tiles]); the synthetic parity image uses the aspect ratio that fills every tile in one row (1 x max_num_tiles).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from .forms import CrossAttentionKV
from .spec import VisionFamily, config_value, pixels

if TYPE_CHECKING:  # numpy loads where an image is made or run, not when the families are read
    import numpy as np

ARCHITECTURES = ("MllamaForConditionalGeneration",)
LANGUAGE_ARCHITECTURE = "MllamaForCausalLM"  # families/mllama.py


def _text(config: Any):
    return config.get_text_config()


def _side(config: Any) -> int:
    return int(config_value(config.vision_config, "image_size"))


def _tiles(config: Any) -> int:
    return int(config_value(config.vision_config, "max_num_tiles"))


def _rows_per_tile(config: Any) -> int:
    return (_side(config) // int(config.vision_config.patch_size)) ** 2 + 1


def _cross_layers(config: Any) -> list[int]:
    return [int(i) for i in _text(config).cross_attention_layers]


def _kv_shape(config: Any) -> tuple[int, int]:
    text = _text(config)
    return int(text.num_key_value_heads), int(text.hidden_size) // int(text.num_attention_heads)


def _vision_module(model):
    import torch

    class MllamaCrossKV(torch.nn.Module):
        """The image -> each cross-attention layer's K (k_norm applied, as transformers caches it) and V."""

        def __init__(self, vlm):
            super().__init__()
            self.inner = vlm.model
            self.layers = _cross_layers(vlm.config)
            self.n_kv, self.head_dim = _kv_shape(vlm.config)
            self.hidden = int(_text(vlm.config).hidden_size)

        def forward(self, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
            states = self.inner.vision_model(pixel_values=pixel_values, aspect_ratio_ids=aspect_ratio_ids,
                                             aspect_ratio_mask=aspect_ratio_mask).last_hidden_state
            bsz = pixel_values.shape[0]
            states = self.inner.multi_modal_projector(states).reshape(bsz, -1, self.hidden)  # images*tiles*rows
            out = []
            for i in self.layers:
                attn = self.inner.language_model.layers[i].cross_attn
                k = attn.k_proj(states).view(bsz, -1, self.n_kv, self.head_dim).transpose(1, 2)
                v = attn.v_proj(states).view(bsz, -1, self.n_kv, self.head_dim).transpose(1, 2)
                out += [attn.k_norm(k), v]
            return tuple(out)

    return MllamaCrossKV(model).eval()


def _kv_modules(model) -> list[Any]:
    """The cross layers' K/V projections and K norm: the vision graph runs them (MllamaCrossKV)."""
    layers = model.model.language_model.layers
    return [getattr(layers[i].cross_attn, name) for i in _cross_layers(model.config) for name in ("k_proj", "v_proj", "k_norm")]


def full_row_aspect_ratio_id(config: Any) -> int:
    """The aspect ratio id (1-based index in supported_aspect_ratios) of 1 x max_num_tiles: every tile used."""
    ratios = [list(r) for r in config.vision_config.supported_aspect_ratios]
    return ratios.index([1, _tiles(config)]) + 1


def _vision_inputs(config: Any, seed: int) -> dict[str, np.ndarray]:
    import numpy as np
    side, tiles = _side(config), _tiles(config)
    return {"pixel_values": pixels((1, 1, tiles, 3, side, side), seed),
            "aspect_ratio_ids": np.full((1, 1), full_row_aspect_ratio_id(config), dtype=np.int64),
            "aspect_ratio_mask": np.ones((1, 1, tiles), dtype=np.int64)}


def _language_model(model) -> tuple[Any, Any, Any]:
    cfg = copy.copy(_text(model.config))
    cfg.architectures = [LANGUAGE_ARCHITECTURE]
    return cfg, model.model.language_model, model.lm_head


def _reference_kwargs(config: Any, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    return {name: inputs[name] for name in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")}


FAMILY = VisionFamily(
    architectures=ARCHITECTURES,
    vision_module=_vision_module,
    vision_inputs=_vision_inputs,
    vision_size=lambda config: _tiles(config) * _rows_per_tile(config),  # the image's K/V rows
    image_token_id=lambda config: int(config_value(config, "image_token_index", "image_token_id")),
    language_model=_language_model,
    reference_kwargs=_reference_kwargs,
    vision_symbols=lambda config: {"batch_size": "1", "max_num_images": "1", "img_size": str(_side(config))},
    vision_axes={"pixel_values": {0: "batch_size", 1: "max_num_images", 4: "img_size", 5: "img_size"},
                 "aspect_ratio_ids": {0: "batch_size", 1: "max_num_images"},
                 "aspect_ratio_mask": {0: "batch_size", 1: "max_num_images"}},
    form=CrossAttentionKV(cross_layers=_cross_layers, grid=lambda config: (_tiles(config), _rows_per_tile(config)),
                          kv_shape=_kv_shape, tile_mask=lambda inputs: inputs["aspect_ratio_mask"][0],
                          symbols=lambda config: {"max_num_images": "1"}, kv_modules=_kv_modules),
    single_qpc=False,  # the single graph would recompute the cross K/V each step; not composed yet (single.py)
)
