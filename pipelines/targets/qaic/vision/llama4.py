"""Llama 4 (Llama4ForConditionalGeneration: Scout, Maverick): transformers' Llama4VisionModel over square tiles
of `image_size`, then its multi_modal_projector; the Llama 4 text decoder (families/llama4.py) reads the rows
over its `image_token_id` placeholders (the `<|patch|>` tokens the processor writes per tile).

What transformers' forward does with pixel_values [tiles, 3, side, side]: the vision model (unfold patch
embedding, a CLS token appended last, learned positions, pre-norm, encoder layers with a 2D RoPE, post-norm,
CLS dropped, pixel shuffle by `pixel_shuffle_ratio` and the adapter MLP) gives [tiles, rows, vision_output_dim]
with rows = (side / patch)^2 * ratio^2; flattened in tile order and projected to the text hidden size, they
fill the placeholders in order. As QEfficient, the graph is compiled for a fixed tile count (`MAX_NUM_TILES`,
QEfficient's default 17: 16 tiles + the global view; the host pads to it) and returns all tiles' rows as one
image, vision_embeds [1, tiles x rows, hidden].

The encoder's attention is computed here rather than by transformers' module: transformers rotates q and k
as complex numbers (view_as_complex and a complex frequency buffer), which the ONNX exporter cannot trace. The
same rotation in real arithmetic (cos / sin of those frequencies, pairs of interleaved dims) reads the layer's
own projections; every other piece (patch embedding, norms, MLPs, pixel shuffle adapter, projector) is
transformers' module, called as is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .spec import VisionFamily, config_value, pixels, text_causal_lm_config

if TYPE_CHECKING:  # numpy loads where an image is made or run, not when the families are read
    import numpy as np

ARCHITECTURES = ("Llama4ForConditionalGeneration",)
MAX_NUM_TILES = 17  # tiles per image the vision graph is compiled for (QEfficient's default max_num_tiles)


def _side(config: Any) -> int:
    size = config_value(config.vision_config, "image_size")
    if isinstance(size, (list, tuple)):
        if size[0] != size[1]:
            from ....core.errors import ModelFormatError

            raise ModelFormatError(f"Llama 4 tiles are square; this vision config's image_size is {tuple(size)}")
        size = size[0]
    return int(size)


def _rows_per_tile(config: Any) -> int:
    vision = config.vision_config
    return int((_side(config) // int(vision.patch_size)) ** 2 * float(vision.pixel_shuffle_ratio) ** 2)


def _vision_module(model):
    import torch

    from ..families.blocks import rotate_interleaved

    class Llama4ImageFeatures(torch.nn.Module):
        def __init__(self, vlm):
            super().__init__()
            self.tower, self.projector = vlm.vision_model, vlm.multi_modal_projector
            cfg = vlm.config.vision_config
            self.heads = int(cfg.num_attention_heads)
            self.head_dim = int(cfg.hidden_size) // self.heads
            freqs = self.tower.rotary_embedding.freqs_ci.reshape(-1, self.head_dim // 2)  # [patches + CLS, pairs]
            self.register_buffer("cos", freqs.real.float().repeat_interleave(2, -1)[None, :, None], persistent=False)
            self.register_buffer("sin", freqs.imag.float().repeat_interleave(2, -1)[None, :, None], persistent=False)

        def attention(self, attn, x):
            tiles, seq = x.shape[0], x.shape[1]
            q, k, v = (proj(x).view(tiles, seq, self.heads, self.head_dim) for proj in (attn.q_proj, attn.k_proj,
                                                                                       attn.v_proj))
            q = q * self.cos + rotate_interleaved(q, self.head_dim) * self.sin
            k = k * self.cos + rotate_interleaved(k, self.head_dim) * self.sin
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.head_dim**-0.5, dim=-1)
            out = torch.matmul(probs, v).transpose(1, 2).reshape(tiles, seq, self.heads * self.head_dim)
            return attn.o_proj(out)

        def forward(self, pixel_values):
            tower = self.tower
            h = tower.patch_embedding(pixel_values)  # [tiles, patches, hidden]
            cls = tower.class_embedding.expand(h.shape[0], 1, h.shape[-1])
            h = tower.layernorm_pre(torch.cat([h, cls], dim=1) + tower.positional_embedding_vlm)
            for layer in tower.model.layers:
                h = h + self.attention(layer.self_attn, layer.input_layernorm(h))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            h = tower.vision_adapter(tower.layernorm_post(h)[:, :-1, :])  # CLS dropped, pixel shuffle + MLP
            rows = self.projector(h.reshape(-1, h.shape[-1]))
            return rows.reshape(1, -1, rows.shape[-1])

    return Llama4ImageFeatures(model).eval()


def _vision_inputs(config: Any, seed: int) -> dict[str, np.ndarray]:
    side = _side(config)
    return {"pixel_values": pixels((MAX_NUM_TILES, 3, side, side), seed)}


def _language_model(model) -> tuple[Any, Any, Any]:
    # transformers' Llama4ForConditionalGeneration holds its Llama4ForCausalLM whole, as `language_model`
    return text_causal_lm_config(model.config.get_text_config()), model.language_model.model, model.language_model.lm_head


FAMILY = VisionFamily(
    architectures=ARCHITECTURES,
    vision_module=_vision_module,
    vision_inputs=_vision_inputs,
    vision_size=lambda config: MAX_NUM_TILES * _rows_per_tile(config),
    vision_symbols=lambda config: {"batch_size": "1", "max_num_tiles": str(MAX_NUM_TILES),
                                   "img_size": str(_side(config))},
    vision_axes={"pixel_values": {0: "max_num_tiles", 2: "img_size", 3: "img_size"}},
    language_model=_language_model,
)
