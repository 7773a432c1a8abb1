"""onnxruntime against transformers for a vision-language export, on a synthetic image (numpy) and the same ids:
- the vision graph alone: its vision_embeds against the family's vision module in torch (max |delta|);
- end to end: the vision graph's embeddings into the language graph (prefill of a prompt with the image's
  placeholders, then greedy decode steps feeding `vision_embeds_RetainedState`, `image_idx_output` and the KV
  back) against transformers' whole model on the same image, teacher-forced on onnxruntime's tokens (top-1, max
  |delta logit|), and both greedy runs' first tokens (`tokens_equal`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..layout import RETAINED
from .spec import VisionFamily


def image_prompt(family: VisionFamily, config: Any, text_ids: list[int]) -> list[int]:
    """The prompt as the processor expands it: the first text token (BOS), one placeholder per image row, the rest."""
    image = [family.image_token_id(config)] * family.vision_size(config)
    return text_ids[:1] + image + text_ids[1:]


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


def _reference(family: VisionFamily, model, ids: list[int], inputs: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    kwargs = dict(family.reference_kwargs(model.config, inputs))
    if family.reference_token_kwargs is not None:
        kwargs.update(family.reference_token_kwargs(model.config, np.asarray([ids], dtype=np.int64)))
    kwargs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **kwargs).logits[0].float().numpy()


def vlm_parity(family: VisionFamily, model, language_onnx: Path, vision_onnx: Path, text_ids: list[int],
               decode_steps: int = 8, seed: int = 0) -> dict[str, Any]:
    """Both halves and the whole against transformers (the model already rounded as the export stores it)."""
    import torch

    from ..ort import compare

    inputs = family.vision_inputs(model.config, seed)
    state = image_state(vision_onnx, inputs)
    embeds = state["vision_embeds"]
    with torch.no_grad():
        out = family.vision_module(model)(*(torch.from_numpy(a) for a in inputs.values()))
    ref_state = dict(zip(family.vision_outputs, [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]))
    prompt = image_prompt(family, model.config, text_ids)
    ctx_len = len(prompt) + decode_steps + 8
    positions = None if family.positions is None else family.positions(model.config, prompt, inputs)
    got = run_language(language_onnx, state, prompt, decode_steps, ctx_len, positions)
    ref = _reference(family, model, prompt + got["tokens"][:-1], inputs)[len(prompt) - 1:]
    greedy, ids = [], list(prompt)
    for _ in range(decode_steps + 1):  # transformers greedy by whole forwards, from the same image
        greedy.append(int(_reference(family, model, ids, inputs)[-1].argmax()))
        ids.append(greedy[-1])
    same = all(name in state and state[name].shape == ref_state[name].shape for name in ref_state)
    vision_delta = max(float(np.abs(state[k] - ref_state[k]).max()) for k in ref_state) if same else None
    return {**compare(ref, got["logits"]), "vision_max_abs_delta": vision_delta, "vision_rows": int(embeds.shape[1]),
            "prompt_tokens": len(prompt), "image_rows_consumed": got["image_rows"][0], "tokens": got["tokens"],
            "reference_tokens": greedy, "tokens_equal": got["tokens"] == greedy}
