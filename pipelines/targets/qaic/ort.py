"""The AI 100 export in onnxruntime: prefill and greedy decode with the retained state fed back (alone, or with
continuous batching over cache rows; a target LM export also in speculative steps of K+1 tokens), and its parity
with transformers on the same ids.

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

from .layout import KEEP_INPUT


def session_options():
    """onnxruntime's options for a check: quiet, and intra-op threads that sleep between operators. A parity run
    is a host's background work beside builds and engines (vLLM's OpenMP threads, another test worker), and
    threads that spin after every small operator hold the cores those need."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def session(onnx_path: Path):
    import onnxruntime as ort

    return ort.InferenceSession(str(onnx_path), sess_options=session_options(), providers=["CPUExecutionProvider"],
                                disabled_optimizers=["ConstantFolding"])


def _empty_state(sess, rows: int, ctx_len: int) -> dict[str, Any]:
    state = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            _b, kv, _ctx, d = i.shape
            state[i.name] = np.zeros((rows, kv, ctx_len, d), dtype=np.float32)
    return state


def _extra(sess, keep: int = 1) -> dict[str, Any]:
    """batch_index 0 (one cache row) for a continuous-batching export, num_logits_to_keep [keep, 1] for a target LM."""
    names = {i.name for i in sess.get_inputs()}
    extra = {"batch_index": np.zeros((1, 1), dtype=np.int64)} if "batch_index" in names else {}
    if KEEP_INPUT in names:
        extra[KEEP_INPUT] = np.zeros((keep, 1), dtype=np.int64)
    return extra


def run_ort(onnx_path: Path, prompt: list[int], decode_steps: int, ctx_len: int, sess=None) -> dict[str, Any]:
    """Prefill the prompt, then greedy-decode `decode_steps` tokens feeding the retained state back
    (a continuous-batching export runs with one cache row, batch_index 0)."""
    sess = sess or session(onnx_path)
    state = _empty_state(sess, 1, ctx_len)
    extra = _extra(sess)
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


def run_ort_speculative(sess, prompt: list[int], drafts: list[int], k: int, steps: int, ctx_len: int) -> dict[str, Any]:
    """A target LM export verifying drafts as vllm-qaic's n-gram speculation does: prefill the prompt (one logit),
    then `steps` decode steps of k+1 tokens (the last accepted token and k drafts at the next positions), all
    k+1 logits returned, the drafts accepted while they equal the greedy token, plus the next greedy token;
    the next step starts after them, so the rejected drafts' K/V stay in the cache, masked, then overwritten.
    The drafts come from `drafts` (the greedy continuation of the prompt) with one of them, chosen by the step's
    index, replaced by another token (none every k+1-th step): the steps accept 0..k drafts.
    -> {"rows": [(ids the step's logits are for, logits [k+1, vocab])], "tokens", "accepted"}."""
    state = _empty_state(sess, 1, ctx_len)
    outputs = [o.name for o in sess.get_outputs()]

    def run(ids: list[int], start: int, keep: int):
        feed = {"input_ids": np.asarray([ids], dtype=np.int64), **_extra(sess, keep),
                "position_ids": np.arange(start, start + len(ids), dtype=np.int64)[None]}
        res = dict(zip(outputs, sess.run(outputs, {**feed, **state})))
        state.update({name: res[f"{name}_RetainedState"] for name in state})
        return res["logits"][0]

    tokens = [int(run(prompt, 0, 1)[-1].argmax())]
    rows, accepted = [], []
    for step in range(steps):
        guess = (list(drafts[len(tokens):len(tokens) + k]) + [0] * k)[:k]
        wrong = step % (k + 1)
        if wrong < k:
            guess[wrong] = 1 if guess[wrong] == 0 else guess[wrong] - 1
        seq = prompt + tokens
        logits = run([seq[-1]] + guess, len(seq) - 1, k + 1)
        rows.append((seq + guess, logits))
        greedy = [int(x) for x in logits.argmax(-1)]
        n = 0
        while n < k and guess[n] == greedy[n]:
            n += 1
        accepted.append(n)
        tokens += greedy[:n + 1]
    return {"rows": rows, "tokens": tokens, "accepted": accepted}


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
    from ...model.streamed_model import StreamedCausalLM
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


def speculative_draft_steps(k: int) -> int:
    """Greedy tokens a speculative run of k+1 steps can accept (each step one more than the last), plus k."""
    return (k + 1) * (k + 2) // 2 + k


def ort_parity(model_dir: Path, onnx_path: Path, prompts: list[list[int]], decode_steps: int = 8, ctx_len: int = 128,
               *, layers: int | None = None, weight_dtype: str = "float16", resident: bool = True,
               speculative: int | None = None) -> list[dict[str, Any]]:
    """ORT (prefill + decode_steps, retained state fed back) against transformers fp32 on the same ids, per
    prompt: transformers scores the prompt followed by ORT's own greedy tokens, teacher-forced. `layers`: the
    export is a slice of that many layers, compared with the reference of the same layers. `speculative`: k of a
    target LM export, which also runs k+1 speculative steps of k+1 tokens (`run_ort_speculative`, the drafts from
    the greedy run) whose every logit is compared with transformers on the same ids; the top-1 and |delta| are
    those of both runs, `speculative` the steps' own."""
    from ...model.unit_memory import trim_heap

    sess = session(onnx_path)
    greedy_steps = max(decode_steps, speculative_draft_steps(speculative)) if speculative else decode_steps
    runs = [run_ort(onnx_path, p, greedy_steps, ctx_len, sess=sess) for p in prompts]
    specs = [run_ort_speculative(sess, p, r["tokens"], speculative, speculative + 1, ctx_len) if speculative else None
             for p, r in zip(prompts, runs)]
    del sess
    trim_heap()
    out = []
    with reference_model(model_dir, layers=layers, weight_dtype=weight_dtype, resident=resident) as lm:
        for p, r, spec in zip(prompts, runs, specs):
            res = {**compare(reference_logits(lm, p, r["tokens"]), r["logits"]), "tokens": r["tokens"]}
            if spec is not None:
                ref = np.concatenate([lm.logits(ids)[-(speculative + 1):] for ids, _ in spec["rows"]])
                got = compare(ref, [row for _, logits in spec["rows"] for row in logits])
                res["speculative"] = {**got, "num_speculative_tokens": speculative, "steps": len(spec["rows"]),
                                      "positions": got["steps"], "accepted": spec["accepted"]}
                res["top1_agreement"] = min(res["top1_agreement"], got["top1_agreement"])
                res["finite"] = res["finite"] and got["finite"]
                deltas = (res["max_abs_logit_delta"], got["max_abs_logit_delta"])
                res["max_abs_logit_delta"] = None if None in deltas else max(deltas)
            out.append(res)
    del lm
    trim_heap()
    return out
