"""Validate a prepared vLLM directory, on the same token ids, three ways:

1. **The artifact in transformers, fp32**, against the transformers fp32 reference of the source: what
   the bf16 rounding (or FP8 quantization) cost. FP8 is evaluated as vLLM computes it: weights
   dequantized from the stored e4m3 bytes and scales, activations quantized per token to e4m3 in
   front of every quantized layer.
2. **The artifact in vLLM** (the vLLM venv, `engine.py`), fp32, against the same artifact in
   transformers fp32: teacher-forced top-1 and logprobs on the parity texts, greedy continuations
   compared token by token, and the ids vLLM's tokenizer gives. Both sides in fp32, so differences
   are the engine's, not the precision's (bf16 on both sides diverges on real models after a few tokens).
3. **Tokenizer**: the artifact's tokenizer gives the source's ids.

A greedy divergence where the reference's two best tokens are within `TIE_MARGIN` (log-probability)
is a numerical tie, not an engine error: it is reported, not failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import parity, prompts, reference
from ...errors import HiveError, ModelFormatError
from . import engine

if TYPE_CHECKING:
    from .. import BuildContext

TIE_MARGIN = 1e-3


def load_fp32(artifact_dir: Path, quantized: bool, source_files: list[Path]) -> tuple[Any, dict[str, float]]:
    """The artifact as a transformers fp32 model, and (FP8) each quantized weight's relative error against
    the source weight. FP8: dequantized weights plus per-token activation quantization hooks (what vLLM's
    W8A8 kernels compute, up to accumulation order)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not quantized:
        return reference.load_model(artifact_dir, "the prepared directory"), {}
    from ...safetensors_io import TensorSource
    from .fp8 import E4M3_MAX, dequantize

    reference._quiet_transformers()

    cfg = AutoConfig.from_pretrained(str(artifact_dir), trust_remote_code=False, local_files_only=True)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=False, dtype=torch.float32).eval()
    state, quantized_modules, errors = {}, set(), {}
    with TensorSource(sorted(artifact_dir.glob("*.safetensors"))) as src, TensorSource(source_files) as original:
        for name in src.names():
            info = src.info(name)
            if name.endswith(".weight_scale"):
                continue
            if info.dtype == "F8_E4M3":
                prefix = name[: -len(".weight")]
                scale = np.array(src.float32(prefix + ".weight_scale"))  # copies: the mmap closes after
                raw = np.array(src.where[name].raw(name)).reshape(info.shape)
                deq = dequantize(raw, scale)
                w = np.array(original.float32(name))
                norm = float(np.linalg.norm(w))
                errors[name] = float(np.linalg.norm(w - deq)) / norm if norm else 0.0
                original.release(name)
                state[name] = torch.from_numpy(deq)
                quantized_modules.add(prefix)
            else:
                state[name] = torch.from_numpy(np.array(src.float32(name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n in missing if n.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ModelFormatError(f"FP8 artifact does not match its model class: missing {sorted(set(missing) - tied)[:3]}, "
                               f"unexpected {sorted(unexpected)[:3]}")
    if tied:
        model.tie_weights()

    def fake_quant(_module, args):
        if not model.quantize_activations:
            return None
        x = args[0]
        scale = (x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
        return (q * scale,) + tuple(args[1:])

    for name, module in model.named_modules():
        if name in quantized_modules:
            module.register_forward_pre_hook(fake_quant)
    model.quantize_activations = True  # W8A8; False computes W8A16 (weights only), as vLLM does without FP8 kernels
    return model, errors


def teacher_forced(model, ids: list[list[int]]) -> list[np.ndarray]:
    import torch

    with torch.inference_mode():
        return [model(torch.tensor([seq], dtype=torch.long)).logits[0].float().numpy() for seq in ids]


def greedy(model, prompt: list[int], n: int) -> dict[str, Any]:
    """Greedy continuation without stopping at EOS (as vLLM with ignore_eos), with each step's logprob of the
    chosen token and the gap to the runner-up (ties are reported, not failed)."""
    import torch

    ids, lps, gaps = [], [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            top2 = torch.topk(lp, 2)
            tok = int(top2.indices[0])
            ids.append(tok)
            lps.append(float(top2.values[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return {"ids": ids, "logprobs": lps, "gaps": gaps}


def compare_engine(tf_logits: list[np.ndarray], ids: list[list[int]], tf_greedy: list[dict[str, Any]],
                   result: dict[str, Any], ref_logits: list[np.ndarray]) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM (runner result) against transformers on the same artifact and ids; and its top-1 against the
    source's fp32 reference (end to end: what serving from this artifact in vLLM gives)."""
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
               "vllm_max_logprob_delta": parity.round6(max_delta), "vllm_greedy_agreement": parity.round6(prompts_ok / len(tf_greedy)),
               "vllm_reference_top1_agreement": parity.round6(ref_agree / max(total, 1)),
               "vllm_greedy_tokens_matched": f"{matched}/{tokens}"}
    details = {"greedy": per_prompt, "engine": result.get("vllm"), "load_seconds": result.get("load_seconds"),
               "cached": result.get("cached", False)}
    return metrics, details


def validate_prepared(ctx: "BuildContext", artifact_dir: Path, digests: list[tuple[str, str]], quantized: bool,
                      engine_required: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    snapshot = ctx.snapshot
    src_tok = reference.load_tokenizer(snapshot.dir)
    art_tok = reference.load_tokenizer(artifact_dir)
    ids = reference.encode(src_tok, prompts.PARITY_TEXTS)
    gen_prompt = reference.encode(src_tok, [prompts.GENERATION_PROMPT])[0]
    greedy_prompts = reference.encode(src_tok, prompts.GREEDY_PROMPTS)
    ref = reference.compute(snapshot.dir, snapshot.content_digest, ids, gen_prompt, prompts.GENERATION_TOKENS,
                            files=snapshot.safetensors_files(), step=f"the transformers reference of {snapshot.model_id}")

    model, weight_errors = load_fp32(artifact_dir, quantized, snapshot.safetensors_files())
    tf_logits = teacher_forced(model, ids)
    per_prompt = [parity.compare(r, a) for r, a in zip(ref.logits, tf_logits)]
    total = parity.merge(per_prompt)
    tf_greedy = [greedy(model, p, prompts.GREEDY_TOKENS) for p in greedy_prompts]
    weight_only = None
    if quantized:
        # Where a platform has no FP8 activation kernels (CUDA sm75-sm86, XPU by default) vLLM runs W8A16:
        # weights dequantized, activations 16-bit. Reported beside the W8A8 numbers the gate uses.
        model.quantize_activations = False
        weight_only = parity.merge([parity.compare(r, a) for r, a in zip(ref.logits, teacher_forced(model, ids))])
    del model

    src_ids = [list(src_tok(t).input_ids) for t in prompts.TOKENIZER_TEXTS]
    art_ids = [list(art_tok(t).input_ids) for t in prompts.TOKENIZER_TEXTS]
    mismatches = [{"text": t, "source": a[:24], "artifact": b[:24]}
                  for t, a, b in zip(prompts.TOKENIZER_TEXTS, src_ids, art_ids) if a != b]

    metrics: dict[str, Any] = {
        "positions": total.positions, "top1_agreement": parity.round6(total.top1_agreement), "mean_kl": parity.round6(total.mean_kl),
        "max_kl": parity.round6(total.max_kl), "max_abs_logit_delta": parity.round6(total.max_abs_logit_delta), "finite": total.finite,
    }
    details: dict[str, Any] = {
        "reference": "transformers fp32 of the source", "prompt_set_version": prompts.VERSION,
        "artifact_in_transformers": "fp32" + (", FP8 weights dequantized, activations quantized per token" if quantized else ""),
        "per_prompt": [p.rounded() for p in per_prompt],
    }
    if weight_only is not None:
        details["w8a16"] = weight_only.rounded()
        metrics["max_weight_rel_error"] = parity.round6(max(weight_errors.values(), default=0.0))
    step = f"vLLM validation of {ctx.model_id} ({ctx.recipe.id})"
    cfg = ctx.config
    max_len = max(len(s) for s in ids + greedy_prompts) + prompts.GREEDY_TOKENS + 8
    job = {"model_dir": str(artifact_dir), "dtype": "float32", "max_model_len": max_len, "sequences": ids,
           "generation_prompts": greedy_prompts, "generation_tokens": prompts.GREEDY_TOKENS,
           "tokenizer_texts": prompts.TOKENIZER_TEXTS}
    if cfg.get("sliding_window") and ctx.compatibility.family == "gemma":
        job["engine_args"] = {"disable_sliding_window": True}
    try:
        result = engine.run(job, digests, step)
    except engine.NoEngine:
        raise
    except HiveError as e:  # EngineFailed / EngineCrashed: one line already
        if engine_required:
            raise
        metrics["vllm_loaded"] = 0.0
        details["vllm"] = {"status": "not loaded on this host", "engine": engine.version(), "reason": str(e),
                           "check_on": "a GPU host: bench/gpu_vllm.sh"}
        vllm_ids = None
    else:
        em, ed = compare_engine(tf_logits, ids, tf_greedy, result, ref.logits)
        metrics.update(em)
        details["vllm"] = {"status": "loaded", "dtype": "float32", **ed}
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
