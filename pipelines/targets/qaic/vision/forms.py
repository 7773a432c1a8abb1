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
(build_decoder), transformers' extra arguments for the same prompt, the language graph run in onnxruntime, the
decoder run over a streamed model (quality prediction), and what the compile records (export.json `vision`: the
language graph's extra symbols and float16 IO).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..layout import DEEPSTACK, RETAINED

if TYPE_CHECKING:  # numpy loads where an image is made or run, not when the families are read
    import numpy as np


# name -> (the image axis, the other dims in order): what each vision graph output holds for one image
Outputs = dict[str, tuple[int, tuple[int, ...]]]


def _text_hidden(config: Any) -> int:
    return int(config.get_text_config().hidden_size)


def _expand(family, config: Any, text_ids: list[int], placeholders: int) -> list[int]:
    """The first text token (BOS), the image's placeholders, the rest of the text."""
    return text_ids[:1] + [family.image_token_id(config)] * placeholders + text_ids[1:]


def _positions(family, config: Any, prompt: list[int], inputs: dict[str, np.ndarray]) -> np.ndarray | None:
    """The family's prompt position_ids (M-RoPE: its t/h/w rows), or None for [1, seq] arange."""
    return None if family.positions is None else family.positions(config, prompt, inputs)


@dataclass(frozen=True)
class MergedRows:
    """Image rows merged over placeholder embeddings (one placeholder per row); with DeepStack (Qwen3-VL) the
    vision graph also outputs per-level features added to those rows after the first decoder layers."""

    def vision_outputs(self, family, config: Any) -> Outputs:
        size, hidden = family.vision_size(config), _text_hidden(config)
        out = {"vision_embeds": (0, (size, hidden))}
        if family.deepstack is not None:  # [levels, images, rows, hidden]
            out[DEEPSTACK] = (1, (family.deepstack(config), size, hidden))
        return out

    def prompt(self, family, config: Any, text_ids: list[int]) -> list[int]:
        return _expand(family, config, text_ids, family.vision_size(config))

    def language_modules_in_vision(self, model) -> list[Any]:
        return []

    def decoder_options(self, family, config: Any) -> dict[str, Any]:
        return {"image_token": family.image_token_id(config),
                "deepstack": 0 if family.deepstack is None else family.deepstack(config)}

    def reference_kwargs(self, family, config: Any, inputs: dict[str, np.ndarray], ids: list[int]) -> dict[str, Any]:
        import numpy as np
        kwargs = dict(family.reference_kwargs(config, inputs))
        if family.reference_token_kwargs is not None:  # e.g. Qwen's mm_token_type_ids
            kwargs.update(family.reference_token_kwargs(config, np.asarray([ids], dtype=np.int64)))
        return kwargs

    def run_language(self, family, config, onnx_path: Path, image: dict[str, np.ndarray], inputs, prompt: list[int],
                     decode_steps: int, ctx_len: int) -> dict[str, Any]:
        from .runs import run_language

        return run_language(onnx_path, image, prompt, decode_steps, ctx_len, _positions(family, config, prompt, inputs))

    def streamed_logits(self, family, config, lm, decoder, image: tuple, inputs, prompt: list[int],
                        image_transform) -> np.ndarray:
        """Every position's logits of the prompt through the decoder over the streamed model (quality.run_decoder),
        the vision module's outputs `image` merged over the placeholders."""
        import torch

        from ..quality import run_decoder

        hook, _out, added = decoder.image_hook(torch.tensor([prompt]), image[0], image[1] if len(image) > 1 else None,
                                               torch.zeros(1, 1, dtype=torch.long))
        positions = _positions(family, config, prompt, inputs)
        positions = torch.arange(len(prompt)).unsqueeze(0) if positions is None else torch.from_numpy(positions)
        return run_decoder(lm, decoder, [prompt], images=[(hook, added)], positions=[positions])[0]

    def compile_record(self, family, config: Any) -> dict[str, Any]:
        names = list(self.vision_outputs(family, config))
        return {"language_symbols": {"vision_batch_size": "1", "vision_size": str(family.vision_size(config))},
                "language_float16_io": names + [f"{n}{RETAINED}" for n in names]}


@dataclass(frozen=True)
class CrossAttentionKV:
    """The image as the K/V of the language model's cross-attention layers (one placeholder token per image).

    - `cross_layers(config)`: the language model's cross-attention layer indices (the vision graph's outputs);
    - `grid(config)`: (tiles per image, image rows per tile): the K/V rows of one image are tiles x rows;
    - `kv_shape(config)`: (n_kv_heads, head_dim) of the cross layers' K/V;
    - `tile_mask(inputs)`: the tiles [images, tiles] (1: valid) a token after the image token sees, from the
      vision inputs;
    - `symbols(config)`: what the language graph's specializations add (QEfficient: max_num_images, img_size);
    - `kv_modules(model)`: the language model's modules the vision graph runs (the cross layers' K/V projections
      and norms): exported with the vision graph, in its precision.
    """

    cross_layers: Callable[[Any], list[int]]
    grid: Callable[[Any], tuple[int, int]]
    kv_shape: Callable[[Any], tuple[int, int]]
    tile_mask: Callable[[dict[str, np.ndarray]], np.ndarray]
    symbols: Callable[[Any], dict[str, str]]
    kv_modules: Callable[[Any], list[Any]]

    def language_modules_in_vision(self, model) -> list[Any]:
        return self.kv_modules(model)

    def vision_outputs(self, family, config: Any) -> Outputs:
        tiles, rows = self.grid(config)
        kv, dim = self.kv_shape(config)
        return {f"past_{kv_name}.{i}": (0, (kv, tiles * rows, dim)) for i in self.cross_layers(config)
                for kv_name in ("key", "value")}

    def prompt(self, family, config: Any, text_ids: list[int]) -> list[int]:
        return _expand(family, config, text_ids, 1)

    def decoder_options(self, family, config: Any) -> dict[str, Any]:
        return {"cross_grid": self.grid(config)}

    def token_masks(self, family, config: Any, inputs: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
        """cross_attention_mask [1, len(ids), images, tiles] (int64): no tile before the first image token, the
        image's valid tiles from it on (transformers' processor, for one image)."""
        import numpy as np
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
        import numpy as np

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

    def streamed_logits(self, family, config, lm, decoder, image: tuple, inputs, prompt: list[int],
                        image_transform) -> np.ndarray:
        """Every position's logits of the prompt through the decoder over the streamed model (quality.run_decoder):
        the vision module's K/V (through `image_transform`: the float16 they are kept in) at the cross layers, the
        prompt's tile mask."""
        import torch

        from ..quality import run_decoder

        kv = dict(zip(self.vision_outputs(family, config), image))
        cross = {i: (image_transform(kv[f"past_key.{i}"]), image_transform(kv[f"past_value.{i}"]))
                 for i in self.cross_layers(config)}
        mask = torch.from_numpy(self.token_masks(family, config, inputs, prompt))
        return run_decoder(lm, decoder, [prompt], cross=[(mask, cross)])[0]

    def compile_record(self, family, config: Any) -> dict[str, Any]:
        """The image's K/V stay float16 on both sides (the vision QPC writes them so; never MXINT8)."""
        names = list(self.vision_outputs(family, config))
        return {"language_symbols": dict(self.symbols(config)),
                "language_float16_io": names + [f"{n}{RETAINED}" for n in names]}


MERGED_ROWS = MergedRows()
