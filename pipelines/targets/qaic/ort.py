"""The AI 100 export in onnxruntime: prefill and greedy decode with the retained state fed back (alone, or with
continuous batching over cache rows), and its parity with transformers on the same ids.

The session leaves onnxruntime's constant folding off: folding would turn every fp16 weight's Cast into an
fp32 copy held for the session's life (twice the export's size in memory); unfolded, one weight at a time is
widened while its node runs. The reference is the streamed transformers model (streamed_model.py) with the
export's own weight rounding (fp16 for matrices stored in fp16), so the comparison measures the graph, not the
storage precision (the compile recipes predict that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def session(onnx_path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["ConstantFolding"])


def _empty_state(sess, rows: int, ctx_len: int) -> dict[str, Any]:
    state = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            _b, kv, _ctx, d = i.shape
            state[i.name] = np.zeros((rows, kv, ctx_len, d), dtype=np.float32)
    return state


def run_ort(onnx_path: Path, prompt: list[int], decode_steps: int, ctx_len: int, sess=None) -> dict[str, Any]:
    """Prefill the prompt, then greedy-decode `decode_steps` tokens feeding the retained state back
    (a continuous-batching export runs with one cache row, batch_index 0)."""
    sess = sess or session(onnx_path)
    state = _empty_state(sess, 1, ctx_len)
    extra = {"batch_index": np.zeros((1, 1), dtype=np.int64)} if any(
        i.name == "batch_index" for i in sess.get_inputs()) else {}
    outputs = [o.name for o in sess.get_outputs()]
    ids = np.asarray([prompt], dtype=np.int64)
    pos = np.arange(len(prompt), dtype=np.int64)[None]
    steps_logits, tokens = [], []
    for _ in range(decode_steps + 1):
        res = dict(zip(outputs, sess.run(outputs, {"input_ids": ids, "position_ids": pos, **state, **extra})))
        logits = res["logits"][0, 0]
        steps_logits.append(logits)
        tok = int(logits.argmax())
        tokens.append(tok)
        state = {name: res[f"{name}_RetainedState"] for name in state}
        ids = np.asarray([[tok]], dtype=np.int64)
        pos = np.asarray([[int(pos[0, -1]) + 1]], dtype=np.int64)
    return {"logits": steps_logits, "tokens": tokens}


def run_ort_continuous(onnx_path: Path, prompts: list[list[int]], slots: list[int], decode_steps: int,
                       ctx_len: int, full_batch_size: int) -> list[dict[str, Any]]:
    """Continuous batching on a `batch_index` export: prefill each prompt alone (batch 1) into its cache
    row `slots[i]` of a [full_batch_size, ...] cache, then greedy-decode all of them together as one batch."""
    sess = session(onnx_path)
    state = _empty_state(sess, full_batch_size, ctx_len)
    outputs = [o.name for o in sess.get_outputs()]

    def step(ids, pos, rows):
        feed = {"input_ids": ids, "position_ids": pos, "batch_index": np.asarray(rows, dtype=np.int64).reshape(-1, 1)}
        res = dict(zip(outputs, sess.run(outputs, {**feed, **state})))
        state.update({name: res[f"{name}_RetainedState"] for name in state})
        return res["logits"][:, 0]

    results = [{"logits": [], "tokens": []} for _ in prompts]
    for r, prompt, slot in zip(results, prompts, slots):
        logits = step(np.asarray([prompt], dtype=np.int64), np.arange(len(prompt), dtype=np.int64)[None], [slot])[0]
        r["logits"].append(logits)
        r["tokens"].append(int(logits.argmax()))
    next_pos = [len(p) for p in prompts]
    for _ in range(decode_steps):
        ids = np.asarray([[r["tokens"][-1]] for r in results], dtype=np.int64)
        logits = step(ids, np.asarray(next_pos, dtype=np.int64)[:, None], slots)
        for r, lg in zip(results, logits):
            r["logits"].append(lg)
            r["tokens"].append(int(lg.argmax()))
        next_pos = [p + 1 for p in next_pos]
    return results


def reference_model(model_dir: Path, *, layers: int | None = None, weight_dtype: str = "float16",
                    resident: bool = True):
    """The transformers model the export is compared with: streamed from the checkpoint, its first `layers`
    layers (a slice), matrices rounded to fp16 where the export stores them so."""
    from ...streamed_model import StreamedCausalLM
    from .external_data import FP16_MAX, stored_dtype

    def rounding(_name, _owner, _attr, value):  # as the export stores them: clipped to fp16's range, rounded
        if stored_dtype(value.dim(), weight_dtype) != "float16":
            return value
        return value.clamp(-FP16_MAX, FP16_MAX).half().float()

    files = sorted(Path(model_dir).glob("*.safetensors"))
    return StreamedCausalLM(Path(model_dir), files, resident=resident, layers=layers,
                            transform=rounding if weight_dtype == "float16" else None)


def reference_logits(lm, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """transformers fp32 logits for the prompt's last position and each fed-back token (teacher-forced)."""
    seq = prompt + tokens[:-1]
    return lm.logits(seq)[len(prompt) - 1:]


def compare(ref, got) -> dict[str, Any]:
    got = np.stack(got)
    finite = bool(np.isfinite(got).all())
    return {"steps": len(got), "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
            "max_abs_logit_delta": float(np.abs(ref - got).max()) if finite else None, "finite": finite}


def ort_parity(model_dir: Path, onnx_path: Path, prompts: list[list[int]], decode_steps: int = 8, ctx_len: int = 128,
               *, layers: int | None = None, weight_dtype: str = "float16", resident: bool = True) -> list[dict[str, Any]]:
    """ORT (prefill + decode_steps, retained state fed back) against transformers fp32 on the same ids, per
    prompt: transformers scores the prompt followed by ORT's own greedy tokens, teacher-forced. `layers`: the
    export is a slice of that many layers, compared with the reference of the same layers."""
    from ...streamed_model import trim_heap

    sess = session(onnx_path)
    runs = [run_ort(onnx_path, p, decode_steps, ctx_len, sess=sess) for p in prompts]
    del sess
    trim_heap()
    with reference_model(model_dir, layers=layers, weight_dtype=weight_dtype, resident=resident) as lm:
        out = [{**compare(reference_logits(lm, p, r["tokens"]), r["logits"]), "tokens": r["tokens"]}
               for p, r in zip(prompts, runs)]
    del lm
    trim_heap()
    return out
