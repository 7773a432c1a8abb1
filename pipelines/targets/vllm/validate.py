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
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    from .. import BuildContext
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
    from ...model.streamed_model import trim_heap
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


def validate_prepared(ctx: BuildContext, artifact_dir: Path, digests: list[tuple[str, str]], quantized: bool,
                      engine_required: bool, how: ValidationLayout) -> tuple[dict[str, Any], dict[str, Any]]:
    """`how`: what this budget affords (plan.layout): the artifact resident or streamed in a child, the engine
    on the whole artifact or a slice, the slice's layers resident or streamed."""
    check, resident = how.check, how.resident
    snapshot = ctx.snapshot
    int_tier = INT_TIERS.get(ctx.recipe.options.get("quantization", "none"))  # W4A16 / INT8 (int_tiers.py)
    fp8 = quantized and int_tier is None
    engine_dtype = int_tier.engine_dtype if int_tier else "float32"
    src_tok, art_tok = CachedTokenizer(snapshot.dir), CachedTokenizer(artifact_dir)
    ids = reference.encode(src_tok, prompts.PARITY_TEXTS)
    gen_prompt = reference.encode(src_tok, [prompts.GENERATION_PROMPT])[0]
    greedy_prompts = reference.encode(src_tok, prompts.GREEDY_PROMPTS)
    ref = reference.compute(snapshot.dir, snapshot.content_digest, ids, gen_prompt, prompts.GENERATION_TOKENS,
                            files=snapshot.safetensors_files(), step=f"the transformers reference of {snapshot.model_id}")
    shards = sorted(artifact_dir.glob("*.safetensors"))
    whole = check.layers is None
    # A source whose shards were carried unchanged (bf16 already): the artifact's weights are the source's files,
    # byte for byte, so its logits are the reference's. Streaming it again would only repeat the reference.
    source_digests = sorted(f.sha256 for f in snapshot.files if f.path.endswith(".safetensors"))
    identical = not quantized and sorted(d for p, d in digests if p.endswith(".safetensors")) == source_digests
    if identical and not whole:
        art = {"logits": list(ref.logits), "greedy": [], "weight_errors": {}, "unit_loads": 0}
    else:
        # The whole artifact in transformers (greedy too when the engine checks the whole artifact: same files);
        # identical shards only for the greedy continuations, their logits being the reference's.
        # W8A16 (informational, not gated) costs a second pass over the weights: only when they are resident.
        art = evaluate(artifact_dir, shards, snapshot.safetensors_files(), [] if identical else ids,
                       greedy_prompts if whole else [], resident=resident, weight_only=fp8 and resident,
                       step=f"the prepared directory of {ctx.model_id} in transformers")
        if identical:
            art["logits"] = list(ref.logits)
    # MoE positions the reference routes on a near-tie (router_gaps.py) are reported apart, as GGUF's validation does
    ties = [None] * len(ids) if ref.router_gaps is None else [g < router_gaps.TIE_BOUND for g in ref.router_gaps]
    per_prompt = [parity.compare(r, a, t) for r, a, t in zip(ref.logits, art["logits"], ties)]
    total = parity.merge(per_prompt)

    src_ids = [list(src_tok(t).input_ids) for t in prompts.TOKENIZER_TEXTS]
    art_ids = [list(art_tok(t).input_ids) for t in prompts.TOKENIZER_TEXTS]
    mismatches = [{"text": t, "source": a[:24], "artifact": b[:24]}
                  for t, a, b in zip(prompts.TOKENIZER_TEXTS, src_ids, art_ids) if a != b]
    errors = art["weight_errors"]
    metrics: dict[str, Any] = {
        "positions": total.positions, "top1_agreement": parity.round6(total.top1_agreement),
        "mean_kl": parity.round6(total.mean_kl), "max_kl": parity.round6(total.max_kl),
        "max_abs_logit_delta": parity.round6(total.max_abs_logit_delta), "finite": total.finite,
        "max_weight_rel_error": parity.round6(max(errors.values(), default=0.0)),
    }
    if ref.router_gaps is not None:  # an MoE model: the near-tie positions, apart from the gated metrics
        metrics["router_near_ties"] = total.near_ties
        if total.near_ties:
            metrics["router_near_tie_top1"] = parity.round6(total.near_tie_top1)
            metrics["router_near_tie_max_kl"] = parity.round6(total.near_tie_max_kl)
    worst = max(errors, key=errors.get) if errors else None
    details: dict[str, Any] = {
        **how.to_json(), "reference": "transformers fp32 of the source", "prompt_set_version": prompts.VERSION,
        "artifact_in_transformers": "fp32" + (int_tier.simulated if int_tier else
                                              ", FP8 weights dequantized, activations quantized per token" if fp8 else ""),
        "artifact_run": _artifact_run(identical, whole, resident, art.get("unit_loads")),
        "weights_compared": len(errors), "worst_weight": worst,
        "per_prompt": [p.rounded() for p in per_prompt],
    }
    if fp8:
        # Where a platform has no FP8 activation kernels (CUDA sm75-sm86, XPU by default) vLLM runs W8A16:
        # weights dequantized, activations 16-bit. Reported beside the W8A8 numbers the gate uses.
        details["w8a16"] = (parity.merge([parity.compare(r, a) for r, a in zip(ref.logits, art["w8a16_logits"])]).rounded()
                            if "w8a16_logits" in art else "not computed: the artifact streamed (a second pass)")

    if not whole:  # the engine checks a slice: the whole artifact's logits are done with; free them first
        art.pop("logits"), art.pop("w8a16_logits", None)
        from ...model.streamed_model import trim_heap

        trim_heap()
    step = f"vLLM validation of {ctx.model_id} ({ctx.recipe.id})"
    with work_dir("vllm-engine-") as work:
        if whole:
            engine_dir, tf_logits, tf_greedy, ref_logits = artifact_dir, art["logits"], art["greedy"], list(ref.logits)
            job_digests = digests
        else:
            # A layer slice of the real files, compared with transformers and the source on the same slice.
            engine_dir = work / "slice"
            write_slice(artifact_dir, check.layers, engine_dir)
            (work / "tf").mkdir()
            (work / "ref").mkdir()
            sl = evaluate(engine_dir, [engine_dir / "model.safetensors"], None, ids, greedy_prompts, layers=check.layers,
                          resident=how.slice_resident, keep=work / "tf", label="slice in transformers",
                          step=f"a {check.layers}-layer slice of {ctx.model_id} in transformers")
            tf_logits, tf_greedy = sl["logits"], sl["greedy"]
            ref_logits = tf_logits if identical else evaluate(  # identical files: the same slice
                snapshot.dir, snapshot.safetensors_files(), None, ids, [], layers=check.layers,
                resident=how.slice_resident, keep=work / "ref", label="reference slice",
                step=f"the reference of the first {check.layers} layers of {ctx.model_id}")["logits"]
            job_digests = sorted(digests) + [("slice_layers", str(check.layers))]
        vlm = is_vlm(ctx.config)  # an image prompt too (vision.py), within a longer context
        max_len = max(len(s) for s in ids + greedy_prompts) + prompts.GREEDY_TOKENS + 8 + (IMAGE_CHECK_TOKENS if vlm else 0)
        job = {"model_dir": str(engine_dir), "dtype": engine_dtype, "max_model_len": max_len, "sequences": ids,
               "generation_prompts": greedy_prompts, "generation_tokens": prompts.GREEDY_TOKENS,
               "tokenizer_texts": prompts.TOKENIZER_TEXTS,
               "engine_args": {"kv_cache_memory_bytes": kv_cache_bytes(model_facts(snapshot), check.layers, max_len)}}
        if fp8:  # which FP8 GEMM the CPU engine runs (runner.choose_fp8_matmul): part of the job, so of its cache key
            job["fp8_matmul"] = settings.VLLM_FP8_MATMUL.choice(("auto", "native", "emulated"))
        if vlm:  # one picture a prompt: vLLM sizes its multimodal profiling and encoder cache by these limits
            job["image_prompts"] = list(IMAGE_PROMPTS)
            job["engine_args"]["limit_mm_per_prompt"] = {"image": 1, "video": 0}
        # this engine build's known defects for this model (engine_defects.py): a workaround the job names, or a record
        longest = max([len(s) for s in ids] + [len(g) + prompts.GREEDY_TOKENS for g in greedy_prompts])
        defects = matching_defects(engine_version(), ctx.compatibility.architecture, ctx.config, longest)
        if any(d.patch for d in defects):
            job["runner_patches"] = sorted({d.patch for d in defects if d.patch})
        try:
            if any(not d.runs for d in defects):  # this engine build cannot run the model at all: not started
                raise UncheckableHere("; ".join(d.reason for d in defects if not d.runs))
            with meter.step("validate", label="vllm check"):
                result = run_engine(job, job_digests, step)
        except NoEngine:
            raise
        except UncheckableHere as e:  # named in the record, its gates not applied (engine_defects.py)
            metrics["vllm_loaded"] = 0.0
            details["vllm"] = {"status": "not checked: this engine build cannot run it", "engine": engine_version(),
                               "reason": str(e), "check_on": "a GPU host: bench/gpu_vllm.sh", **defects_record(defects)}
            vllm_ids = None
        except HiveError as e:  # EngineFailed / EngineCrashed: one line already
            if engine_required:
                raise
            metrics["vllm_loaded"] = 0.0
            details["vllm"] = {"status": "not loaded on this host", "engine": engine_version(), "reason": str(e),
                               "check_on": "a GPU host: bench/gpu_vllm.sh"}
            vllm_ids = None
        else:
            em, ed = compare_engine(tf_logits, ids, tf_greedy, result, ref_logits)
            if vlm:  # transformers on the processor's own tensors of each image prompt, on the files vLLM loaded
                im, ed["image_prompts"] = check_images(result, engine_dir, check.layers,
                                                       resident if whole else how.slice_resident, ctx.config,
                                                       work / "images", step)
                em.update(im)
            metrics.update(em)
            details["vllm"] = {"status": "loaded", "dtype": engine_dtype, "checked": check.mode,
                               **({"dtype_reason": int_tier.engine_dtype_reason} if int_tier else {}),
                               **({"layers": check.layers} if check.layers else {}), **ed, **defects_record(defects)}
            if ed.get("engine"):  # the engine this artifact was checked in: pull compares it with a serving container's
                details["engines"] = {"vllm": str(ed["engine"]).split("+")[0]}
            vllm_ids = result["tokenized"]
    if vllm_ids is not None:
        mismatches += [{"text": t, "transformers": a[:24], "vllm": b[:24]}
                       for t, a, b in zip(prompts.TOKENIZER_TEXTS, art_ids, vllm_ids) if a != b]
    compared = len(prompts.TOKENIZER_TEXTS) * (2 if vllm_ids is not None else 1)
    metrics["token_parity"] = parity.round6(1 - len(mismatches) / compared)
    details["tokenizer_mismatches"] = mismatches
    return metrics, details

