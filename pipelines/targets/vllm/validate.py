"""Validate a prepared vLLM directory, on the same token ids, three ways, within the memory budget:

1. **The artifact in transformers, fp32**, against the transformers fp32 reference of the source: what
   the bf16 rounding (or FP8 quantization) cost. Run unit by unit from the published files
   (artifact_model.py: resident when the fp32 model fits with margin, else streamed in a child process):
   FP8 as vLLM computes it, weights dequantized from the stored e4m3 bytes and scales, activations
   quantized per token in front of every quantized layer. Every weight is compared with the source's as it
   streams (`max_weight_rel_error`).
2. **The artifact in vLLM** (the vLLM venv, `engine.py`), fp32, against transformers fp32 on the same
   files: teacher-forced top-1 and logprobs on the parity texts, greedy continuations compared token by
   token, and the ids vLLM's tokenizer gives. Both sides in fp32, so differences are the engine's, not the
   precision's. The whole artifact when vLLM's process fits the budget, else a layer slice of the real files
   (engine_check.py), compared with transformers and the source's reference on the same slice; the record
   says which (`engine_check`). A vision-language model's engine check adds an image prompt, compared with
   transformers on the processor's own tensors after the image (vision.py).
3. **Tokenizer**: the artifact's tokenizer gives the source's ids.

A greedy divergence where the reference's two best tokens are within `TIE_MARGIN` (log-probability)
is a numerical tie, not an engine error: it is reported, not failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ...core import meter, settings
from ...core.errors import EngineFailed, HiveError
from ...core.paths import work_dir
from ...model.memory import model_facts
from ...validation import parity, prompts, reference, router_gaps
from ...validation.tokenizer_cache import CachedTokenizer
from .engine import NoEngine, run as run_engine, version as engine_version
from .engine_check import kv_cache_bytes, write_slice
from .engine_defects import matching as matching_defects, record as defects_record
from .int_tiers import INT_TIERS
from .vision import IMAGE_CHECK_TOKENS, IMAGE_PROMPTS, check_images, is_vlm

if TYPE_CHECKING:
    from ...validation.reference import Reference
    from .. import BuildContext
    from .int_tiers import IntTier
    from .plan import ValidationLayout

TIE_MARGIN = 1e-3


class UncheckableHere(HiveError):
    """A known defect of this engine build stops it from running the model (engine_defects.py: `runs=False`)."""


def evaluate(model_dir: Path, files: list[Path], source_files: list[Path] | None, sequences: list[list[int]],
             greedy_prompts: list[list[int]], *, resident: bool, layers: int | None = None,
             weight_only: bool = False, step: str, keep: Path | None = None,
             label: str = "artifact in transformers") -> dict[str, Any]:
    """The artifact (or its first `layers` layers) in transformers: logits of `sequences` (and W8A16 ones with
    `weight_only`), greedy continuations, weight errors. The whole artifact resident runs in this process (it
    fits with margin); anything else in a child, whose memory goes back when it ends, so the parent stays at
    its tokenizers and logits while the engine runs beside it. `keep`: a directory the logits stay in, read
    back memory-mapped (the parent holds no copy while the engine runs); else they are loaded."""
    from ...model.unit_memory import trim_heap
    from ...process.isolation import run_isolated
    from .artifact_model import evaluate_into

    with work_dir("vllm-eval-") as tmp, meter.step("validate", label=label):  # reported as a step of its own
        work = keep or tmp
        args = dict(model_dir=str(model_dir), files=[str(f) for f in files],
                    source_files=[str(f) for f in source_files] if source_files else None, sequences=sequences,
                    greedy_prompts=greedy_prompts, greedy_tokens=prompts.GREEDY_TOKENS, out_dir=str(work),
                    resident=resident, layers=layers, weight_only=weight_only)
        if resident and layers is None:
            evaluate_into(**args)
            trim_heap()
        else:
            run_isolated(evaluate_into, engine="transformers", needs_torch=True, step=step, **args)
        done = json.loads((work / "done.json").read_text())
        meter.work(flop=done.get("flop", 0))
        mode = "r" if keep is not None else None
        done["logits"] = [np.load(work / f"l{i}.npy", mmap_mode=mode) for i in range(len(sequences))]
        if weight_only:
            done["w8a16_logits"] = [np.load(work / f"w{i}.npy", mmap_mode=mode) for i in range(len(sequences))]
    return done


def compare_engine(tf_logits: list[np.ndarray], ids: list[list[int]], tf_greedy: list[dict[str, Any]],
                   result: dict[str, Any], ref_logits: list[np.ndarray]) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM (runner result) against transformers on the same files and ids; and its top-1 against the
    source's fp32 reference (end to end: what serving from this artifact in vLLM gives)."""
    _check_complete(ids, tf_greedy, result)
    agree = total = ref_agree = 0
    max_delta = 0.0
    for seq, logits, ref, rows in zip(ids, tf_logits, ref_logits, result["sequences"]):
        lp = parity.log_softmax(logits)
        # vLLM's row p scores the token at p+1 (the first prompt position has no prediction)
        for p, (top_id, _top_lp, actual_lp) in enumerate(rows):
            total += 1
            agree += int(top_id == int(lp[p].argmax()))
            ref_agree += int(top_id == int(ref[p].argmax()))
            max_delta = max(max_delta, abs(actual_lp - float(lp[p, seq[p + 1]])))
    prompts_ok, per_prompt, matched, tokens = 0, [], 0, 0
    for text, ref, got in zip(prompts.GREEDY_PROMPTS, tf_greedy, result["greedy"]):
        n = next((i for i, (a, b) in enumerate(zip(ref["ids"], got["ids"])) if a != b), min(len(ref["ids"]), len(got["ids"])))
        identical = n == len(ref["ids"]) == len(got["ids"])
        tie = not identical and n < len(ref["gaps"]) and ref["gaps"][n] < TIE_MARGIN
        prompts_ok += int(identical or tie)
        matched += n
        tokens += len(ref["ids"])
        deltas = [abs(a - b) for a, b in zip(ref["logprobs"][:n], got["logprobs"][:n])]
        per_prompt.append({"prompt": text, "identical": identical, "diverged_at": None if identical else n,
                           "near_tie": tie, "max_logprob_delta": parity.round6(max(deltas, default=0.0))})
        max_delta = max(max_delta, max(deltas, default=0.0))
    metrics = {"vllm_loaded": 1.0, "vllm_positions": total, "vllm_top1_agreement": parity.round6(agree / max(total, 1)),
               "vllm_max_logprob_delta": parity.round6(max_delta),
               "vllm_greedy_agreement": parity.round6(prompts_ok / len(tf_greedy)),
               "vllm_reference_top1_agreement": parity.round6(ref_agree / max(total, 1)),
               "vllm_greedy_tokens_matched": f"{matched}/{tokens}"}
    details = {"greedy": per_prompt, "engine": result.get("vllm"), "load_seconds": result.get("load_seconds"),
               "cached": result.get("cached", False),
               **({"fp8_matmul": result["fp8_matmul"]} if result.get("fp8_matmul") else {})}
    return metrics, details


def _check_complete(ids: list[list[int]], tf_greedy: list[dict[str, Any]], result: dict[str, Any]) -> None:
    """The engine's result answers every question asked: a sequence or a greedy run it left out would
    otherwise drop out of the comparison (zip) and leave the agreement looking better than it is."""
    rows = [len(r) for r in result.get("sequences", [])]
    wanted = [len(seq) - 1 for seq in ids]
    greedy = len(result.get("greedy", []))
    if rows != wanted or greedy != len(tf_greedy):
        raise EngineFailed(f"vLLM answered {len(rows)} of {len(ids)} sequences ({sum(rows)} of {sum(wanted)} "
                           f"positions) and {greedy} of {len(tf_greedy)} greedy runs: an incomplete result, "
                           "nothing was published")


def _artifact_run(identical: bool, whole: bool, resident: bool, unit_loads: int | None) -> str:
    ran = "resident" if resident else f"streamed unit by unit ({unit_loads} unit loads)"
    if not identical:
        return ran
    carried = "identical to the source (its shards are the source's files): the reference's logits"
    return f"{carried}; greedy continuations {ran}" if whole else carried


@dataclass(frozen=True)
class _Validation:
    """What the steps of one validation read: the build, the prepared directory and its digests, what the budget
    affords, the INT tier (or FP8), the token ids and the source's fp32 reference."""

    ctx: BuildContext
    artifact_dir: Path
    digests: list[tuple[str, str]]
    how: ValidationLayout
    int_tier: IntTier | None
    fp8: bool
    ids: list[list[int]]
    greedy_prompts: list[list[int]]
    ref: Reference
    identical: bool  # the artifact's shards are the source's files, byte for byte

    @property
    def whole(self) -> bool:
        """The engine checks the whole artifact (not a layer slice)."""
        return self.how.check.layers is None

    @property
    def engine_dtype(self) -> str:
        return self.int_tier.engine_dtype if self.int_tier else "float32"


class _EngineInputs(NamedTuple):
    """What the engine runs (the artifact or its slice) and what its answers are compared with."""

    model_dir: Path
    tf_logits: list[np.ndarray]
    tf_greedy: list[dict[str, Any]]
    ref_logits: list[np.ndarray]
    digests: list[tuple[str, str]]  # the engine job's cache key


def validate_prepared(ctx: BuildContext, artifact_dir: Path, digests: list[tuple[str, str]], quantized: bool,
                      engine_required: bool, how: ValidationLayout) -> tuple[dict[str, Any], dict[str, Any]]:
    """`how`: what this budget affords (plan.layout): the artifact resident or streamed in a child, the engine
    on the whole artifact or a slice, the slice's layers resident or streamed."""
    snapshot = ctx.snapshot
    int_tier = INT_TIERS.get(ctx.recipe.options.get("quantization", "none"))  # W4A16 / INT8 (int_tiers.py)
    src_tok, art_tok = CachedTokenizer(snapshot.dir), CachedTokenizer(artifact_dir)
    ids, greedy_prompts, ref = _source_reference(ctx, src_tok)
    v = _Validation(ctx, artifact_dir, digests, how, int_tier, quantized and int_tier is None, ids, greedy_prompts,
                    ref, _carried_unchanged(ctx, digests, quantized))
    art = _artifact_in_transformers(v)
    per_prompt, total = _artifact_parity(v, art)
    art_ids, mismatches = _tokenizer_mismatches(src_tok, art_tok)
    metrics, details = _artifact_record(v, art, per_prompt, total)

    if not v.whole:  # the engine checks a slice: the whole artifact's logits are done with; free them first
        art.pop("logits"), art.pop("w8a16_logits", None)
        from ...model.unit_memory import trim_heap

        trim_heap()
    with work_dir("vllm-engine-") as work:
        vllm_ids = _engine_check(v, _engine_inputs(v, art, work), work, engine_required, metrics, details)
    if vllm_ids is not None:
        mismatches += [{"text": t, "transformers": a[:24], "vllm": b[:24]}
                       for t, a, b in zip(prompts.TOKENIZER_TEXTS, art_ids, vllm_ids) if a != b]
    compared = len(prompts.TOKENIZER_TEXTS) * (2 if vllm_ids is not None else 1)
    metrics["token_parity"] = parity.round6(1 - len(mismatches) / compared)
    details["tokenizer_mismatches"] = mismatches
    return metrics, details


def _source_reference(ctx: BuildContext, src_tok: CachedTokenizer) -> tuple[list[list[int]], list[list[int]], Reference]:
    """The source tokenizer's ids of the parity texts and greedy prompts, and the transformers fp32 reference."""
    snapshot = ctx.snapshot
    ids = reference.encode(src_tok, prompts.PARITY_TEXTS)
    greedy_prompts = reference.encode(src_tok, prompts.GREEDY_PROMPTS)
    # the logits only: vLLM's greedy runs are compared with the artifact's own scored continuations
    ref = reference.compute(snapshot.dir, snapshot.content_digest, ids, files=snapshot.safetensors_files(),
                            step=f"the transformers reference of {snapshot.model_id}")
    return ids, greedy_prompts, ref


def _carried_unchanged(ctx: BuildContext, digests: list[tuple[str, str]], quantized: bool) -> bool:
    """Whether the source's shards were carried unchanged (bf16 already): the artifact's weights are the source's
    files, byte for byte, so its logits are the reference's. Streaming it again would only repeat the reference."""
    source_digests = sorted(f.sha256 for f in ctx.snapshot.files if f.path.endswith(".safetensors"))
    return not quantized and sorted(d for p, d in digests if p.endswith(".safetensors")) == source_digests


def _artifact_in_transformers(v: _Validation) -> dict[str, Any]:
    """The artifact run in transformers (evaluate): its logits (the reference's when its shards are the source's),
    greedy continuations when the engine checks the whole artifact, weight errors."""
    if v.identical and not v.whole:
        return {"logits": list(v.ref.logits), "greedy": [], "weight_errors": {}, "unit_loads": 0}
    # The whole artifact in transformers (greedy too when the engine checks the whole artifact: same files);
    # identical shards only for the greedy continuations, their logits being the reference's.
    # W8A16 (informational, not gated) costs a second pass over the weights: only when they are resident.
    shards = sorted(v.artifact_dir.glob("*.safetensors"))
    resident = v.how.resident
    art = evaluate(v.artifact_dir, shards, v.ctx.snapshot.safetensors_files(), [] if v.identical else v.ids,
                   v.greedy_prompts if v.whole else [], resident=resident, weight_only=v.fp8 and resident,
                   step=f"the prepared directory of {v.ctx.model_id} in transformers")
    if v.identical:
        art["logits"] = list(v.ref.logits)
    return art


def _artifact_parity(v: _Validation, art: dict[str, Any]) -> tuple[list[parity.Parity], parity.Parity]:
    """The artifact's logits against the reference's, per prompt and merged."""
    # MoE positions the reference routes on a near-tie (router_gaps.py) are reported apart, as GGUF's validation does
    ref = v.ref
    ties = [None] * len(v.ids) if ref.router_gaps is None else [g < router_gaps.TIE_BOUND for g in ref.router_gaps]
    per_prompt = [parity.compare(r, a, t) for r, a, t in zip(ref.logits, art["logits"], ties)]
    return per_prompt, parity.merge(per_prompt)


def _tokenizer_mismatches(src_tok: CachedTokenizer, art_tok: CachedTokenizer) -> tuple[list[list[int]], list[dict]]:
    """The artifact tokenizer's ids of the tokenizer texts, and the texts the source's tokenizer splits otherwise."""
    src_ids = [list(src_tok(t).input_ids) for t in prompts.TOKENIZER_TEXTS]
    art_ids = [list(art_tok(t).input_ids) for t in prompts.TOKENIZER_TEXTS]
    mismatches = [{"text": t, "source": a[:24], "artifact": b[:24]}
                  for t, a, b in zip(prompts.TOKENIZER_TEXTS, src_ids, art_ids) if a != b]
    return art_ids, mismatches


def _artifact_record(v: _Validation, art: dict[str, Any], per_prompt: list[parity.Parity],
                     total: parity.Parity) -> tuple[dict[str, Any], dict[str, Any]]:
    """The metrics and details of the artifact in transformers against the reference (and W8A16's, for FP8)."""
    errors = art["weight_errors"]
    metrics: dict[str, Any] = {
        "positions": total.positions, "top1_agreement": parity.round6(total.top1_agreement),
        "mean_kl": parity.round6(total.mean_kl), "max_kl": parity.round6(total.max_kl),
        "max_abs_logit_delta": parity.round6(total.max_abs_logit_delta), "finite": total.finite,
        "max_weight_rel_error": parity.round6(max(errors.values(), default=0.0)),
    }
    if v.ref.router_gaps is not None:  # an MoE model: the near-tie positions, apart from the gated metrics
        metrics["router_near_ties"] = total.near_ties
        if total.near_ties:
            metrics["router_near_tie_top1"] = parity.round6(total.near_tie_top1)
            metrics["router_near_tie_max_kl"] = parity.round6(total.near_tie_max_kl)
    worst = max(errors, key=errors.get) if errors else None
    int_tier, fp8 = v.int_tier, v.fp8
    details: dict[str, Any] = {
        **v.how.to_json(), "reference": "transformers fp32 of the source", "prompt_set_version": prompts.VERSION,
        "artifact_in_transformers": "fp32" + (int_tier.simulated if int_tier else
                                              ", FP8 weights dequantized, activations quantized per token" if fp8 else ""),
        "artifact_run": _artifact_run(v.identical, v.whole, v.how.resident, art.get("unit_loads")),
        "weights_compared": len(errors), "worst_weight": worst,
        "per_prompt": [p.rounded() for p in per_prompt],
    }
    if fp8:
        # Where a platform has no FP8 activation kernels (CUDA sm75-sm86, XPU by default) vLLM runs W8A16:
        # weights dequantized, activations 16-bit. Reported beside the W8A8 numbers the gate uses.
        details["w8a16"] = (parity.merge([parity.compare(r, a) for r, a in zip(v.ref.logits, art["w8a16_logits"])]).rounded()
                            if "w8a16_logits" in art else "not computed: the artifact streamed (a second pass)")
    return metrics, details


def _engine_inputs(v: _Validation, art: dict[str, Any], work: Path) -> _EngineInputs:
    """The whole artifact with its transformers run; or a layer slice of the real files, written under `work` and
    run in transformers, with the source's reference on the same slice."""
    if v.whole:
        return _EngineInputs(v.artifact_dir, art["logits"], art["greedy"], list(v.ref.logits), v.digests)
    ctx, layers, slice_resident = v.ctx, v.how.check.layers, v.how.slice_resident
    engine_dir = work / "slice"
    write_slice(v.artifact_dir, layers, engine_dir)
    (work / "tf").mkdir()
    (work / "ref").mkdir()
    sl = evaluate(engine_dir, [engine_dir / "model.safetensors"], None, v.ids, v.greedy_prompts, layers=layers,
                  resident=slice_resident, keep=work / "tf", label="slice in transformers",
                  step=f"a {layers}-layer slice of {ctx.model_id} in transformers")
    ref_logits = sl["logits"] if v.identical else evaluate(  # identical files: the same slice
        ctx.snapshot.dir, ctx.snapshot.safetensors_files(), None, v.ids, [], layers=layers,
        resident=slice_resident, keep=work / "ref", label="reference slice",
        step=f"the reference of the first {layers} layers of {ctx.model_id}")["logits"]
    return _EngineInputs(engine_dir, sl["logits"], sl["greedy"], ref_logits,
                         sorted(v.digests) + [("slice_layers", str(layers))])


def _engine_job(v: _Validation, engine_dir: Path, vlm: bool) -> tuple[dict[str, Any], list]:
    """The engine runner's job (what it loads, runs and compares: its cache key with the digests), and this engine
    build's known defects for this model (engine_defects.py)."""
    ctx, ids, greedy_prompts = v.ctx, v.ids, v.greedy_prompts
    max_len = max(len(s) for s in ids + greedy_prompts) + prompts.GREEDY_TOKENS + 8 + (IMAGE_CHECK_TOKENS if vlm else 0)
    job = {"model_dir": str(engine_dir), "dtype": v.engine_dtype, "max_model_len": max_len, "sequences": ids,
           "generation_prompts": greedy_prompts, "generation_tokens": prompts.GREEDY_TOKENS,
           "tokenizer_texts": prompts.TOKENIZER_TEXTS,
           "engine_args": {"kv_cache_memory_bytes": kv_cache_bytes(model_facts(ctx.snapshot), v.how.check.layers, max_len)}}
    if v.fp8:  # which FP8 GEMM the CPU engine runs (runner.choose_fp8_matmul): part of the job, so of its cache key
        job["fp8_matmul"] = settings.VLLM_FP8_MATMUL.choice(("auto", "native", "emulated"))
    if vlm:  # one picture a prompt: vLLM sizes its multimodal profiling and encoder cache by these limits
        job["image_prompts"] = list(IMAGE_PROMPTS)
        job["engine_args"]["limit_mm_per_prompt"] = {"image": 1, "video": 0}
    # this engine build's known defects for this model (engine_defects.py): a workaround the job names, or a record
    longest = max([len(s) for s in ids] + [len(g) + prompts.GREEDY_TOKENS for g in greedy_prompts])
    defects = matching_defects(engine_version(), ctx.compatibility.architecture, ctx.config, longest)
    if any(d.patch for d in defects):
        job["runner_patches"] = sorted({d.patch for d in defects if d.patch})
    return job, defects


def _engine_check(v: _Validation, inputs: _EngineInputs, work: Path, engine_required: bool, metrics: dict[str, Any],
                  details: dict[str, Any]) -> list[list[int]] | None:
    """The artifact (or its slice) in vLLM, recorded in `metrics` and `details`: loaded and compared, not checked
    (a known defect of this engine build), or not loaded on this host. vLLM's token ids; None when it did not run."""
    ctx, check, how = v.ctx, v.how.check, v.how
    step = f"vLLM validation of {ctx.model_id} ({ctx.recipe.id})"
    vlm = is_vlm(ctx.config)  # an image prompt too (vision.py), within a longer context
    job, defects = _engine_job(v, inputs.model_dir, vlm)
    try:
        if any(not d.runs for d in defects):  # this engine build cannot run the model at all: not started
            raise UncheckableHere("; ".join(d.reason for d in defects if not d.runs))
        with meter.step("validate", label="vllm check"):
            result = run_engine(job, inputs.digests, step)
            if check.layers is None:  # the whole model (a slice's share of the work is not known here)
                # the positions vLLM ran, at the reference's work per position: the check's rate beside the GEMM's
                positions = sum(map(len, v.ids)) + sum(len(p) + prompts.GREEDY_TOKENS for p in v.greedy_prompts)
                meter.work(flop=v.ref.flop_per_position * positions)
    except NoEngine:
        raise
    except UncheckableHere as e:  # named in the record, its gates not applied (engine_defects.py)
        metrics["vllm_loaded"] = 0.0
        details["vllm"] = {"status": "not checked: this engine build cannot run it", "engine": engine_version(),
                           "reason": str(e), "check_on": "a GPU host: bench/gpu_vllm.sh", **defects_record(defects)}
        return None
    except HiveError as e:  # EngineFailed / EngineCrashed: one line already
        if engine_required:
            raise
        metrics["vllm_loaded"] = 0.0
        details["vllm"] = {"status": "not loaded on this host", "engine": engine_version(), "reason": str(e),
                           "check_on": "a GPU host: bench/gpu_vllm.sh"}
        return None
    em, ed = compare_engine(inputs.tf_logits, v.ids, inputs.tf_greedy, result, inputs.ref_logits)
    if vlm:  # transformers on the processor's own tensors of each image prompt, on the files vLLM loaded
        im, ed["image_prompts"] = check_images(result, inputs.model_dir, check.layers,
                                               how.resident if v.whole else how.slice_resident, ctx.config,
                                               work / "images", step)
        em.update(im)
    metrics.update(em)
    details["vllm"] = {"status": "loaded", "dtype": v.engine_dtype, "checked": check.mode,
                       **({"dtype_reason": v.int_tier.engine_dtype_reason} if v.int_tier else {}),
                       **({"layers": check.layers} if check.layers else {}), **ed, **defects_record(defects)}
    if ed.get("engine"):  # the engine this artifact was checked in: pull compares it with a serving container's
        details["engines"] = {"vllm": str(ed["engine"]).split("+")[0]}
    return result["tokenized"]
