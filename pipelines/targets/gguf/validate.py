"""Validate a GGUF with llama.cpp against the transformers fp32 reference on the same token ids."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core import meter
from ...core.progress import bar
from ...validation import parity, prompts, reference, router_gaps
from ...validation.tokenizer_cache import CachedTokenizer
from .llama_log import capture_errors, reason

if TYPE_CHECKING:
    from ...source.fetch import Snapshot


PROBE_TEXT = "a"  # does the tokenizer put BOS in front of a text?


def _reference_tokenizer(snapshot: Snapshot, tok):
    """The tokenizer llama.cpp's ids must equal: the model's own SentencePiece model when it has one.

    transformers 5 rebuilds SentencePiece tokenizers with a pre-tokenizer that drops the leading
    "▁" after a special token or before existing leading spaces, where SentencePiece itself (and
    llama.cpp) add it; no GGUF setting reproduces that, and SentencePiece is the ground truth.
    """
    spm_path = snapshot.file("tokenizer.model")
    if spm_path is None:
        return (lambda text: list(tok(text).input_ids)), "hf"
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromFile(str(spm_path))
    probe = list(tok(PROBE_TEXT).input_ids)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id] else []
    return (lambda text: bos + list(sp.encode(text))), "sentencepiece"


# llama.cpp's CPU backend copies quantized weights (Q4_0, Q4_K, IQ4_NL, ...) into interleaved rows in
# anonymous memory for its fastest kernels: a second, resident copy of the model (measured at 8B: 3.9 GiB
# for a 4.6 GiB Q4_K_M). A larger GGUF is evaluated from the mapped file as it is (other kernels, memory
# bounded by the page cache). Decided by the artifact's size, never by the host's memory, so a build's
# validation numbers are the same on every host.
REPACK_MAX_BYTES = 8 << 30
# llama.cpp's worker threads spin at a barrier after every op: on a small model, whose ops take microseconds,
# more threads than the work needs only wait for each other's time slices (a 2-layer test model's 20 prompt
# evaluations: 1.6 s on one thread, 13 s on two, on a busy 2-core host). One thread per this many bytes of
# GGUF, up to the CPUs this process may run on; thread count does not change llama.cpp's results.
BYTES_PER_THREAD = 256 << 20


def validation_threads(gguf_bytes: int) -> int:
    return max(1, min(len(os.sched_getaffinity(0)), gguf_bytes // BYTES_PER_THREAD + 1))


def _without_repacking() -> None:
    """Make llama-cpp-python's next model load skip the repacked copy (`use_extra_bufts`, llama.cpp's
    --no-repack), which its high-level API does not expose. Only ever called in the validation child."""
    import llama_cpp.llama_cpp as lib

    defaults = lib.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def name_hint(gguf_path: str, errors: list[str]) -> str:
    """libllama gives a model whose general.name contains "phi3" / "phi-3" Phi-3's token attributes by name,
    looking up "</s>" and "<|end|>" without checking they exist: with a vocabulary that lacks them, loading
    fails with a bare `unordered_map::at`."""
    if not any("unordered_map::at" in e for e in errors):
        return ""
    import gguf

    field = gguf.GGUFReader(gguf_path).get_field("general.name")
    name = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field is not None else ""
    if "phi3" in name.lower() or "phi-3" in name.lower():
        return (f" (general.name {name!r} makes llama.cpp give the vocabulary Phi-3's special tokens by name, and "
                f"this vocabulary lacks one of them: publish the model under a name without 'phi3')")
    return ""


def run_llama_cpp(gguf_path: str, sequences: list[list[int]], texts: list[str], generation_prompt: list[int],
                  generation_tokens: int, logits_dir: str, repack: bool = True) -> dict[str, Any]:
    """llama.cpp's side of validation; runs in a child process (pipelines.process.isolation), so a native crash
    is an error line, not a dead build. The GGUF is memory-mapped (its pages are page cache, not a copy
    in this process). Logits go to `l<i>.npy` files in `logits_dir` ([len(sequences[i]), vocab] float32),
    one sequence at a time: with a 128k vocabulary they are ~0.5 MB per token. `repack`: see
    REPACK_MAX_BYTES. Returns llama.cpp's token ids of `texts` and its greedy ids."""
    from llama_cpp import Llama

    if not repack:
        _without_repacking()
    n_ctx = max(len(s) for s in sequences + [generation_prompt]) + generation_tokens + 8
    errors = capture_errors()
    try:
        llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, use_mmap=True,
                    verbose=False, seed=0, n_threads=validation_threads(Path(gguf_path).stat().st_size))
    except ValueError:  # "Failed to load model from file": say what libllama said
        raise ValueError(f"llama.cpp cannot load {Path(gguf_path).name}: {reason(errors)}"
                         f"{name_hint(gguf_path, errors)}") from None
    evals = bar(len(sequences) + 1 + generation_tokens, "llama.cpp check", unit="eval")
    try:
        for i, seq in enumerate(sequences):
            llm.reset()
            llm.eval(seq)
            np.save(Path(logits_dir) / f"l{i}.npy", np.asarray(llm.scores[: len(seq)], dtype=np.float32))
            evals.update()
        tokenized = [llm.tokenize(text.encode("utf-8"), add_bos=True, special=True) for text in texts]
        llm.reset()
        llm.eval(generation_prompt)
        evals.update()
        generated: list[int] = []
        for _ in range(generation_tokens):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(nxt)
            if nxt == llm.token_eos():
                break
            llm.eval([nxt])
            evals.update()
    finally:
        evals.close()
        llm.close()
    return {"tokenized": tokenized, "generated": generated}


def validate_gguf(snapshot: Snapshot, gguf_path: Path, step: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Metrics of a GGUF against the transformers fp32 reference. The reference and the comparison run
    here; llama.cpp runs in a child process (`step` names it in a crash message)."""
    from ...core.paths import work_dir
    from ...process.isolation import run_isolated

    # The tokenizer's answers, every question at once. This process holds torch only where its plan counts it
    # (a reference that fits in it, gguf/plan.py): otherwise what the cache lacks is asked in a child.
    here = reference.reference_resident(snapshot.safetensors_files())
    tok = CachedTokenizer(snapshot.dir)
    tok.prepare(texts=[*prompts.PARITY_TEXTS, prompts.GENERATION_PROMPT, *prompts.TOKENIZER_TEXTS, PROBE_TEXT],
                here=here)
    ids = reference.encode(tok, prompts.PARITY_TEXTS)
    gen_prompt = reference.encode(tok, [prompts.GENERATION_PROMPT])[0]
    ref = reference.compute(snapshot.dir, snapshot.content_digest, ids, gen_prompt, prompts.GENERATION_TOKENS,
                            files=snapshot.safetensors_files(), step=f"the transformers reference of {snapshot.model_id}")

    with work_dir("llama-logits-") as tmp, meter.step("validate", label="llama.cpp check"):
        out = run_isolated(run_llama_cpp, engine="llama.cpp",
                           step=step or f"GGUF validation of {snapshot.model_id}", gguf_path=str(gguf_path),
                           sequences=ids, texts=prompts.TOKENIZER_TEXTS, generation_prompt=gen_prompt,
                           generation_tokens=prompts.GENERATION_TOKENS, logits_dir=str(tmp),
                           repack=gguf_path.stat().st_size <= REPACK_MAX_BYTES)
        # One prompt's pair of [tokens x vocab] arrays in memory at a time.
        # MoE positions the reference routes on a near-tie are reported apart (router_gaps.py)
        ties = [None if ref.router_gaps is None else ref.router_gaps[i] < router_gaps.TIE_BOUND for i in range(len(ids))]
        per_prompt = [parity.compare(np.asarray(ref.logits[i]), np.load(tmp / f"l{i}.npy"), ties[i])
                      for i in range(len(ids))]
        # the positions llama.cpp ran, at the reference's work per position: the check's rate beside the GEMM's
        meter.work(flop=ref.flop_per_position * (sum(map(len, ids)) + len(gen_prompt) + len(out["generated"])))
    total = parity.merge(per_prompt)

    reference_ids, reference_name = _reference_tokenizer(snapshot, tok)
    mismatches = []
    for text, cpp_ids in zip(prompts.TOKENIZER_TEXTS, out["tokenized"]):
        ref_ids = reference_ids(text)
        if ref_ids != cpp_ids:
            mismatches.append({"text": text, reference_name: ref_ids[:24], "llama_cpp": cpp_ids[:24]})
    token_parity = 1 - len(mismatches) / len(prompts.TOKENIZER_TEXTS)

    gen = out["generated"]
    tok.prepare(decodes=[gen, ref.generation_ids], here=here)
    agree = 0
    for a, b in zip(gen, ref.generation_ids):
        if a != b:
            break
        agree += 1

    metrics = {
        "positions": total.positions,
        "top1_agreement": parity.round6(total.top1_agreement),
        "mean_kl": parity.round6(total.mean_kl),
        "max_kl": parity.round6(total.max_kl),
        "max_abs_logit_delta": parity.round6(total.max_abs_logit_delta),
        "finite": total.finite,
        "token_parity": parity.round6(token_parity),
        "greedy_prefix_match": agree,
    }
    if ref.router_gaps is not None:  # an MoE model: the near-tie positions, apart from the gated metrics
        metrics["router_near_ties"] = total.near_ties
        if total.near_ties:
            metrics["router_near_tie_top1"] = parity.round6(total.near_tie_top1)
            metrics["router_near_tie_max_kl"] = parity.round6(total.near_tie_max_kl)
    details = {
        "reference": "transformers fp32",
        # the engine this artifact was checked in: pull compares it with a serving container's
        "engines": {"llama_cpp_python": _engine_version()},
        "prompt_set_version": prompts.VERSION,
        "per_prompt": [p.rounded() for p in per_prompt],
        "tokenizer_reference": reference_name,
        "tokenizer_mismatches": mismatches,
        "generation": {
            "prompt": prompts.GENERATION_PROMPT,
            "artifact": tok.decode(gen),
            "reference": tok.decode(ref.generation_ids),
        },
    }
    return metrics, details


def _engine_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return "absent"
