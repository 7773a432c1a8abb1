"""How a vision-language family's image reaches its language model: the `form` field of a VisionFamily (spec.py),
read by the one export (export.py) and the one parity run (parity.py), so neither branches on a family.

- MergedRows (LLaVA and most VLMs): the vision graph outputs `vision_embeds` [images, vision_size, hidden]; the
  prompt holds one placeholder token per image row; the language graph writes the rows over the placeholders'
  embeddings (decoder.py `merge_image`) and keeps them as `vision_embeds_RetainedState`.
- CrossAttentionKV (Mllama): the vision graph outputs the K/V of every cross-attention layer of the language
  model (`past_key.{i}` / `past_value.{i}`, QEfficient's names); the prompt holds ONE placeholder per image; the
  language graph takes them as the cross layers' retained state (read from the device at every decode step)
  and a `cross_attention_mask` [batch, seq_len, images, tiles] saying which tiles each token sees (none before
  the image token; the image's valid tiles from it on, as transformers' processor writes it).

A form gives: the vision graph's outputs and their per-image shapes, the prompt, the decoder's image options
(build_decoder), transformers' extra arguments for the same prompt, the language graph run in onnxruntime, and
what the compile records (export.json `vision`: the language graph's extra symbols and float16 IO).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..layout import RETAINED


def _text_hidden(config: Any) -> int:
    return int(config.get_text_config().hidden_size)


def _expand(family, config: Any, text_ids: list[int], placeholders: int) -> list[int]:
    """The first text token (BOS), the image's placeholders, the rest of the text."""
    return text_ids[:1] + [family.image_token_id(config)] * placeholders + text_ids[1:]


def run_merged_rows(onnx_path: Path, vision_embeds: np.ndarray, prompt: list[int], decode_steps: int,
                 ctx_len: int) -> dict[str, Any]:
    """Prefill then greedy decode on the language graph, every retained output fed back (one cache row)."""
    from ..ort import _empty_state, _extra, session

    sess = session(onnx_path)
    state = _empty_state(sess, 1, ctx_len)
    extra = _extra(sess)
    outputs = [o.name for o in sess.get_outputs()]
    ids = np.asarray([prompt], dtype=np.int64)
    pos = np.arange(len(prompt), dtype=np.int64)[None]
    image = {"vision_embeds": vision_embeds.astype(np.float32), "image_idx": np.zeros((1, 1), dtype=np.int64)}
    logits_steps, tokens, image_rows = [], [], []
    for _ in range(decode_steps + 1):
        res = dict(zip(outputs, sess.run(outputs, {"input_ids": ids, "position_ids": pos, **image, **state, **extra})))
        logits = res["logits"][0, 0]
        logits_steps.append(logits)
        tokens.append(int(logits.argmax()))
        state = {name: res[f"{name}{RETAINED}"] for name in state}
        image = {"vision_embeds": res[f"vision_embeds{RETAINED}"], "image_idx": res["image_idx_output"]}
        image_rows.append(int(res["image_idx_output"].reshape(-1)[0]))
        ids = np.asarray([[tokens[-1]]], dtype=np.int64)
        pos = np.asarray([[int(pos[0, -1]) + 1]], dtype=np.int64)
    return {"logits": logits_steps, "tokens": tokens, "image_rows": image_rows}


@dataclass(frozen=True)
class MergedRows:
    """Image rows merged over placeholder embeddings (one placeholder per row)."""

    def vision_outputs(self, family, config: Any) -> dict[str, tuple[int, ...]]:
        return {"vision_embeds": (family.vision_size(config), _text_hidden(config))}

    def prompt(self, family, config: Any, text_ids: list[int]) -> list[int]:
        return _expand(family, config, text_ids, family.vision_size(config))

    def decoder_options(self, family, config: Any) -> dict[str, Any]:
        return {"image_token": family.image_token_id(config)}

    def reference_kwargs(self, family, config: Any, inputs: dict[str, np.ndarray], ids: list[int]) -> dict[str, Any]:
        return family.reference_kwargs(config, inputs)

    def run_language(self, family, config, onnx_path: Path, image: dict[str, np.ndarray], inputs, prompt: list[int],
                     decode_steps: int, ctx_len: int) -> dict[str, Any]:
        return run_merged_rows(onnx_path, image["vision_embeds"], prompt, decode_steps, ctx_len)

    def decoder_args(self, family, config, image, inputs, prompt: list[int], decoder, image_transform) -> tuple:
        """The torch decoder's inputs for a whole prompt (quality prediction): the vision module's output
        `image`, an empty cache of len(prompt) slots."""
        import torch

        empty = torch.zeros(1, decoder.n_kv, len(prompt), decoder.head_dim)
        return (torch.tensor([prompt]), image, torch.arange(len(prompt)).unsqueeze(0),
                torch.zeros(1, 1, dtype=torch.long), *[empty] * (2 * len(decoder.layers)))

    def compile_record(self, family, config: Any) -> dict[str, Any]:
        return {"language_symbols": {"vision_batch_size": "1", "vision_size": str(family.vision_size(config))},
                "language_float16_io": ["vision_embeds", f"vision_embeds{RETAINED}"]}


@dataclass(frozen=True)
class CrossAttentionKV:
    """The image as the K/V of the language model's cross-attention layers (one placeholder token per image).

    - `cross_layers(config)`: the language model's cross-attention layer indices (the vision graph's outputs);
    - `grid(config)`: (tiles per image, image rows per tile): the K/V rows of one image are tiles x rows;
    - `kv_shape(config)`: (n_kv_heads, head_dim) of the cross layers' K/V;
    - `tile_mask(inputs)`: the tiles [images, tiles] (1: valid) a token after the image token sees, from the
      vision inputs;
    - `symbols(config)`: what the language graph's specializations add (QEfficient: max_num_images, img_size).
    """

    cross_layers: Callable[[Any], list[int]]
    grid: Callable[[Any], tuple[int, int]]
    kv_shape: Callable[[Any], tuple[int, int]]
    tile_mask: Callable[[dict[str, np.ndarray]], np.ndarray]
    symbols: Callable[[Any], dict[str, str]]

    def vision_outputs(self, family, config: Any) -> dict[str, tuple[int, ...]]:
        tiles, rows = self.grid(config)
        kv, dim = self.kv_shape(config)
        return {f"past_{kv_name}.{i}": (kv, tiles * rows, dim) for i in self.cross_layers(config)
                for kv_name in ("key", "value")}

    def prompt(self, family, config: Any, text_ids: list[int]) -> list[int]:
        return _expand(family, config, text_ids, 1)

    def decoder_options(self, family, config: Any) -> dict[str, Any]:
        return {"cross_grid": self.grid(config)}

    def token_masks(self, family, config: Any, inputs: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
        """cross_attention_mask [1, len(ids), images, tiles] (int64): no tile before the first image token, the
        image's valid tiles from it on (transformers' processor, for one image)."""
        tiles = self.tile_mask(inputs).astype(np.int64)
        token = family.image_token_id(config)
        first = ids.index(token) if token in ids else len(ids)
        mask = np.zeros((1, len(ids), *tiles.shape), dtype=np.int64)
        mask[0, first:] = tiles
        return mask

    def reference_kwargs(self, family, config: Any, inputs: dict[str, np.ndarray], ids: list[int]) -> dict[str, Any]:
        return {**family.reference_kwargs(config, inputs),
                "cross_attention_mask": self.token_masks(family, config, inputs, ids)}

    def run_language(self, family, config, onnx_path: Path, image: dict[str, np.ndarray], inputs, prompt: list[int],
                     decode_steps: int, ctx_len: int) -> dict[str, Any]:
        """Prefill then greedy decode, the cross K/V given once (from the vision graph) and fed back as retained
        state like the self-attention cache; each step's mask row repeats the prompt's last (generate's rule)."""
        from ..ort import _extra, session

        sess = session(onnx_path)
        extra = _extra(sess)
        state = {}
        for i in sess.get_inputs():
            if i.name.startswith("past_"):
                state[i.name] = image[i.name] if i.name in image else np.zeros((1, i.shape[1], ctx_len, i.shape[3]),
                                                                               dtype=np.float32)
        outputs = [o.name for o in sess.get_outputs()]
        ids = np.asarray([prompt], dtype=np.int64)
        pos = np.arange(len(prompt), dtype=np.int64)[None]
        mask = self.token_masks(family, config, inputs, prompt)
        logits_steps, tokens = [], []
        for _ in range(decode_steps + 1):
            feed = {"input_ids": ids, "cross_attention_mask": mask, "position_ids": pos, **state, **extra}
            res = dict(zip(outputs, sess.run(outputs, feed)))
            logits_steps.append(res["logits"][0, 0])
            tokens.append(int(logits_steps[-1].argmax()))
            state = {name: res[f"{name}{RETAINED}"] for name in state}
            ids = np.asarray([[tokens[-1]]], dtype=np.int64)
            pos = np.asarray([[int(pos[0, -1]) + 1]], dtype=np.int64)
            mask = mask[:, -1:]
        return {"logits": logits_steps, "tokens": tokens, "image_rows": [None] * len(tokens)}

    def decoder_args(self, family, config, image, inputs, prompt: list[int], decoder, image_transform) -> tuple:
        """The torch decoder's inputs for a whole prompt (quality prediction): the vision module's K/V (through
        `image_transform`: the float16 they are kept in) at the cross layers, an empty cache elsewhere."""
        import torch

        kv = dict(zip(self.vision_outputs(family, config), image))
        past = []
        for i in range(len(decoder.layers)):
            for name in (f"past_key.{i}", f"past_value.{i}"):
                past.append(image_transform(kv[name]) if name in kv else
                            torch.zeros(1, decoder.n_kv, len(prompt), decoder.head_dim))
        mask = torch.from_numpy(self.token_masks(family, config, inputs, prompt))
        return (torch.tensor([prompt]), mask, torch.arange(len(prompt)).unsqueeze(0), *past)

    def compile_record(self, family, config: Any) -> dict[str, Any]:
        """The image's K/V stay float16 on both sides (the vision QPC writes them so; never MXINT8)."""
        names = list(self.vision_outputs(family, config))
        return {"language_symbols": dict(self.symbols(config)),
                "language_float16_io": names + [f"{n}{RETAINED}" for n in names]}


MERGED_ROWS = MergedRows()
