"""onnxruntime parity of the `qaic-export` artifacts that are not loaded whole by their family module: causal-LM
decoders (streamed reference, a slice of the export when the whole does not fit the budget, the target LM's
multi-token steps) and Whisper (the Encoder step, then Decode steps). Called by QaicExportTarget.validate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import BuildContext

PARITY_DECODE_STEPS = 8
WHISPER_PARITY_CTX = 32  # the decoder cache of the Whisper parity run (the start token + 8 steps)
PARITY_SPECULATIVE_TOKENS = 5  # a target LM export is checked in steps of the seed's quick start (K = 5)


def speech_parity(ctx: BuildContext, onnx_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Whisper: the Encoder step on a synthetic log-mel, then Decode steps with the retained self and cross KV
    fed back, against transformers fp32 on the same ids; and greedy end to end."""
    from ...validation import parity
    from .whisper import load_model, log_mel, start_tokens, whisper_parity

    model = load_model(ctx.snapshot.dir)
    start = start_tokens(model)  # the prompt generate builds: start, language, task, no timestamps
    r = whisper_parity(model, onnx_path, log_mel(model.config), start, decode_steps=PARITY_DECODE_STEPS,
                       ctx_len=WHISPER_PARITY_CTX)
    metrics = {"ort_top1_agreement": r["top1_agreement"] if r["tokens_equal"] else 0.0, "ort_steps": r["steps"],
               "finite": r["finite"]}
    if r["max_abs_logit_delta"] is not None:
        metrics["ort_max_abs_delta"] = parity.round6(r["max_abs_logit_delta"])
    details = {"ort": {k: v for k, v in r.items() if k not in ("tokens", "reference_tokens")}, "prompt": start,
               "reference": "transformers fp32 (WhisperForConditionalGeneration, decoder_input_ids), a synthetic log-mel"}
    return metrics, details


def decoder_parity(ctx: BuildContext, tok, onnx_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """onnxruntime on the export (or, when it does not fit the budget, on a graph of its first layers over the
    same data file) against the streamed reference of the same layers."""
    from ...core.host import memory_budget
    from ...model.memory import model_facts
    from ...validation import parity, prompts
    from .export import slice_graph
    from .ort import ort_parity
    from .plan import ort_check, reference_resident

    facts, budget = model_facts(ctx.snapshot), memory_budget()[0]
    weight_dtype = ctx.recipe.options.get("weight_dtype", "float16")
    check = ort_check(facts, budget, weight_dtype)
    graph = onnx_path
    if check.layers is not None:
        graph = slice_graph(ctx.snapshot.dir, onnx_path, check.layers, onnx_path.with_name(f"slice-{check.layers}.onnx"))
    from .ort import speculative_draft_steps

    ids = [list(tok(text).input_ids)[:48] for text in prompts.PARITY_TEXTS[:2]]
    spd = PARITY_SPECULATIVE_TOKENS if ctx.recipe.options.get("target_lm") else None
    steps = max(PARITY_DECODE_STEPS, speculative_draft_steps(spd) + spd) if spd else PARITY_DECODE_STEPS
    ctx_len = max(len(i) for i in ids) + steps + 8
    resident = reference_resident(facts, check.layers, budget)
    runs = ort_parity(ctx.snapshot.dir, graph, ids, decode_steps=PARITY_DECODE_STEPS, ctx_len=ctx_len,
                      layers=check.layers, weight_dtype=weight_dtype, resident=resident, speculative=spd)
    deltas = [r["max_abs_logit_delta"] for r in runs]
    metrics = {"ort_top1_agreement": min(r["top1_agreement"] for r in runs),
               "ort_steps": sum(r["steps"] for r in runs), "finite": all(r["finite"] for r in runs)}
    if spd:  # decode steps of K+1 tokens, every logit compared
        metrics["ort_speculative_steps"] = sum(r["speculative"]["steps"] for r in runs)
    if all(d is not None for d in deltas):  # not finite: the gate says it was not measured
        metrics["ort_max_abs_delta"] = parity.round6(max(deltas))
    details = {"ort": [{k: v for k, v in r.items() if k != "tokens"} for r in runs], "ort_check": check.to_json(),
               "reference": f"transformers fp32, matrices rounded to {weight_dtype} as stored"}
    return metrics, details
