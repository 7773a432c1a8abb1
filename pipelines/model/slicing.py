"""A layer slice of a model: its first N decoder layers with everything outside the layers (embeddings,
final norm, head).

Where a whole artifact does not fit the memory budget of its engine check (vLLM at fp32, onnxruntime),
the engine loads a slice of the real artifact instead: the same file format, quantization config and
tensor names, with fewer layers. Logits of a slice are not the model's logits, so a slice is only ever
compared with the reference of the same slice (the streamed model with `layers=N`).

A config is sliced by its layer count and by every per-layer list in it (`layer_types`, `mlp_only_layers`,
...: a list as long as the layer count is taken to be indexed by layer).
"""

from __future__ import annotations

import copy
import re
from typing import Any

# config.json spellings of the decoder's layer count
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# a decoder/encoder layer's tensors share a `<...>.layers.N.` prefix (Llama, Mistral, Qwen), `h.N.` (GPT-2,
# Falcon, Bloom), `blocks.N.` (RWKV, Mamba) or `layer.N.` (BERT)
LAYER_TENSOR = re.compile(r"^(.*?(?:^|\.)(?:layers|h|blocks|layer)\.(\d+))\.")
MIN_LAYERS = 2  # a slice shorter than this checks no layer-to-layer wiring (the KV cache of a second layer)


def layer_of(tensor_name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None for tensors outside the layers."""
    m = LAYER_TENSOR.match(tensor_name)
    return int(m.group(2)) if m else None


def in_slice(tensor_name: str, layers: int) -> bool:
    layer = layer_of(tensor_name)
    return layer is None or layer < layers


def _slice_mapping(cfg: dict[str, Any], layers: int) -> None:
    for key in LAYER_COUNT_KEYS:
        original = cfg.get(key)
        if isinstance(original, int) and not isinstance(original, bool) and original > layers:
            cfg[key] = layers
            for k, v in list(cfg.items()):
                if isinstance(v, list) and len(v) == original:
                    cfg[k] = v[:layers]


def slice_config(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """config.json of the first `layers` layers (a copy; nested text_config sliced too)."""
    out = copy.deepcopy(cfg)
    _slice_mapping(out, layers)
    if isinstance(out.get("text_config"), dict):
        _slice_mapping(out["text_config"], layers)
    return out


def slice_transformers_config(config, layers: int) -> None:
    """The same, in place, on a transformers config object (and its text config)."""
    for target in {id(c): c for c in (config, config.get_text_config())}.values():
        attrs = vars(target)
        _slice_mapping(attrs, layers)
