"""The language graph of a merged-rows VLM and its vision graph run in onnxruntime (numpy in, numpy out): what the
parity run (parity.py), the single-QPC check (single.py) and the tests drive. One cache row, greedy decode, every
retained output fed back as the device does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..layout import RETAINED


def run_vision(onnx_path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return image_state(onnx_path, inputs)["vision_embeds"]


def image_state(onnx_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of the vision graph by name (vision_embeds, and e.g. deepstack_features): the language
    graph's image state."""
    from ..ort import session

    sess = session(onnx_path)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))


def next_positions(pos: np.ndarray) -> np.ndarray:
    """The position_ids of the token after `pos` (one per batch row): [batch, 1] the last text position + 1; under
    M-RoPE ([rows, batch, seq]) row 0 likewise, and every RoPE row the largest RoPE position + 1, as transformers
    continues them after a prompt (rope_deltas = max + 1 - prompt length, added to the cache position)."""
    if pos.ndim == 2:
        return pos.max(axis=-1, keepdims=True) + 1
    text = pos[:1].max(axis=-1, keepdims=True) + 1
    rope = pos[1:].max(axis=(0, 2), keepdims=True) + 1
    return np.concatenate([text, np.repeat(rope, pos.shape[0] - 1, axis=0)], axis=0)


def run_language(onnx_path: Path, vision_embeds: np.ndarray | dict[str, np.ndarray], prompt: list[int],
                 decode_steps: int, ctx_len: int, positions: np.ndarray | None = None) -> dict[str, Any]:
    """Prefill then greedy decode on the language graph, every retained output fed back (one cache row).
    `vision_embeds`: the vision graph's vision_embeds, or all its outputs (image_state) by name.
    `positions`: the prompt's position_ids (default [1, seq] arange); decode steps continue them (next_positions)."""
    from ..ort import _empty_state, _extra, session

    sess = session(onnx_path)
    state = _empty_state(sess, 1, ctx_len)
    extra = _extra(sess)
    outputs = [o.name for o in sess.get_outputs()]
    ids = np.asarray([prompt], dtype=np.int64)
    pos = np.arange(len(prompt), dtype=np.int64)[None] if positions is None else positions.astype(np.int64)
    state_in = vision_embeds if isinstance(vision_embeds, dict) else {"vision_embeds": vision_embeds}
    image = {**{k: v.astype(np.float32) for k, v in state_in.items()}, "image_idx": np.zeros((1, 1), dtype=np.int64)}
    logits_steps, tokens, image_rows = [], [], []
    for _ in range(decode_steps + 1):
        res = dict(zip(outputs, sess.run(outputs, {"input_ids": ids, "position_ids": pos, **image, **state, **extra})))
        logits = res["logits"][0, 0]
        logits_steps.append(logits)
        tokens.append(int(logits.argmax()))
        state = {name: res[f"{name}{RETAINED}"] for name in state}
        image = {**{k: res[f"{k}{RETAINED}"] for k in state_in}, "image_idx": res["image_idx_output"]}
        image_rows.append(int(res["image_idx_output"].reshape(-1)[0]))
        ids = np.asarray([[tokens[-1]]], dtype=np.int64)
        pos = next_positions(pos)
    return {"logits": logits_steps, "tokens": tokens, "image_rows": image_rows}
