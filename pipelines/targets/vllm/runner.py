"""vLLM's side of validating a prepared directory. Runs as a script in the vLLM venv (`make setup`
creates it), never imported by hive-aot: that venv has vLLM and its own torch/transformers, not hive-aot.

    python runner.py JOB.json RESULT.json

JOB: model_dir, dtype, max_model_len, sequences (token ids, scored teacher-forced through
prompt_logprobs), generation_prompts (token ids, greedy), generation_tokens, tokenizer_texts.
RESULT: per sequence and position [top-1 id, top-1 logprob, logprob of the actual next token];
greedy token ids with their logprobs; the ids vLLM's tokenizer gives the texts; versions and timings;
for an FP8 artifact, which FP8 matmul ran (`fp8_matmul`, below).

A script file, not stdin: vLLM's engine start spawns processes that re-import the main module. A warm
server (pipelines/warm.py) runs it too: `preload()` once, then `main(argv)` in a forked child per job.
"""

import json
import sys
import time
import weakref


def skip_input_embedding_packing() -> None:
    """vLLM's CPU backend gives every vocab-parallel layer a oneDNN matmul handle holding a packed copy of its
    weight, the input embedding included, which only ever gathers rows: a vocabulary x hidden copy nothing uses
    (4 GiB at 70B in fp32). The input embedding keeps its weight and skips that; the head (and a head tied to the
    embedding) is packed as vLLM does. Where the layout of vLLM's modules differs, nothing is changed."""
    try:
        from vllm.model_executor.layers import vocab_parallel_embedding as vpe
    except ImportError:
        return
    method = getattr(vpe, "UnquantizedEmbeddingMethod", None)
    original = getattr(method, "process_weights_after_loading", None)
    if original is None or getattr(original, "_hive_aot", False):
        return

    def process_weights_after_loading(self, layer):
        if type(layer) is vpe.VocabParallelEmbedding:  # an input embedding, not a (subclassed) head
            return None
        return original(self, layer)

    process_weights_after_loading._hive_aot = True
    method.process_weights_after_loading = process_weights_after_loading


# FP8 matmul on CPU. vLLM's CPU backend runs a channel-wise FP8 artifact (per-channel weight scales, per-token
# activations) through torch._scaled_mm where the CPU has no AMX-FP8 kernel; torch hands that to oneDNN, whose fast
# FP8 path needs AMX-FP16/AVX10.2 and which otherwise runs a reference loop converting every FP8 element on every
# multiply-add: 6-10x slower than the emulation below at Llama-3-8B/70B shapes on an AMD EPYC, and on the CPU a CI
# host drew, 20 minutes for a 135M model's check (a 70B slice would take hours). Which kernel a host gets depends
# on the CPU generation it draws. Where the probe measures the emulation faster, the same products are computed
# as an fp32 GEMM of the FP8 values (exact in fp32) times the scales: vLLM's loading, scale layout and per-token
# activation quantization still run as they are; only the GEMM's loop differs (bench/vllm_fp8_matmul.py).
FP8_SLOW_RATIO = 1.5  # emulate where torch._scaled_mm takes this many times the emulation's time, or more
# tokens x in x out: a prefill's 17 rows (vLLM's padding for this kernel) through a 2048 x 2048 weight, large
# enough to show the reference loop as it is at model shapes (64 x 512 x 512 did not), ~20 ms on an EPYC's loop
FP8_PROBE_SHAPE = (17, 2048, 2048)


def best_seconds(fn, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def probe_fp8_matmul() -> float:
    """How many times the emulation's time torch._scaled_mm (FP8 in, fp32 out, unit scales: vLLM's channel-wise
    call) takes on this CPU, at FP8_PROBE_SHAPE, warm (the emulation's weight already kept in bf16)."""
    import torch

    m, k, n = FP8_PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a8 = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
    b8 = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn).t()
    one = torch.ones(1)
    native = torch._scaled_mm
    emulated = emulated_scaled_mm(native)
    emulated(a8, b8, one, one, out_dtype=torch.float32)  # warm-up: keeps the bf16 copy, as for a layer's weight
    native(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32)
    t_emulated = best_seconds(lambda: emulated(a8, b8, one, one, out_dtype=torch.float32), 3)
    t_native = best_seconds(lambda: native(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32))
    return t_native / max(t_emulated, 1e-6)


def widen_bf16(x16):
    """bf16 -> fp32 by moving each value's 16 bits up (exact), in the tensor's storage order: numpy does it 3x
    faster than torch's .float() on CPU (41 ms against 119 ms for a 4096 x 14336 weight here)."""
    import numpy as np
    import torch

    flip = x16.dim() == 2 and not x16.is_contiguous() and x16.t().is_contiguous()  # vLLM's transposed weight
    bits = (x16.t() if flip else x16.contiguous()).view(torch.int16).numpy().view(np.uint16)
    out = np.empty(bits.shape, np.uint32)
    np.left_shift(bits, 16, out=out, dtype=np.uint32)
    wide = torch.from_numpy(out.view(np.float32))
    return wide.t() if flip else wide


def emulated_scaled_mm(original):
    """torch._scaled_mm for CPU tensors as fp32 arithmetic: (A x B) in fp32 (every FP8 value and product is exact
    there; the sums round as any fp32 GEMM does) times the row scales of A and the column scales of B, plus bias,
    in `out_dtype`. Anything else (other devices, block scales, a result scale, no out_dtype) goes to `original`.

    B is a layer's weight in every call vLLM makes. Widening e4m3 to fp32 costs 4x the GEMM on CPU, so each weight
    keeps a bf16 copy while it lives (every e4m3 value is exact in bf16: 8 exponent bits, 7 of mantissa) and is
    widened from that per call. Its 1 + 2 bytes per parameter stay within the 4 engine_check.engine_memory counts
    for every weight (fp32), with the one weight widened at a time inside the difference."""
    import torch

    narrow: dict[int, tuple] = {}  # id(B) -> (weak reference to B, its bf16 copy); dropped when B is freed

    def widened(b):
        hit = narrow.get(id(b))
        if hit is None or hit[0]() is not b:
            copy = b.to(torch.bfloat16)
            try:
                narrow[id(b)] = (weakref.ref(b, lambda _gone, key=id(b): narrow.pop(key, None)), copy)
            except TypeError:  # not weakly referable: not a module's weight, widened each time
                return copy.to(torch.float32)
            hit = narrow[id(b)]
        return widen_bf16(hit[1])

    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        rows, cols = a.shape[0], b.shape[1]
        if (a.device.type != "cpu" or out_dtype is None or scale_result is not None or a.dim() != 2
                or scale_a.numel() not in (1, rows) or scale_b.numel() not in (1, cols)):
            return original(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)
        out = torch.mm(a.to(torch.float32), widened(b))
        out.mul_(scale_a.to(torch.float32).reshape(-1, 1) if scale_a.numel() > 1 else scale_a.to(torch.float32))
        out.mul_(scale_b.to(torch.float32).reshape(1, -1) if scale_b.numel() > 1 else scale_b.to(torch.float32))
        if bias is not None:
            out.add_(bias.to(torch.float32))
        return out.to(out_dtype)

    scaled_mm._hive_aot = True
    scaled_mm.original = original
    scaled_mm.narrow = narrow
    return scaled_mm


def _cpu_engine() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # torch alone (the tests of this module): the CPU
        return True
    return bool(current_platform.is_cpu())


def choose_fp8_matmul(requested: str) -> dict:
    """`requested`: "auto" (probe, emulate where that is faster), "native" or "emulated". What ran, and why, goes
    into the result."""
    import torch

    if not _cpu_engine():  # a GPU vLLM never calls torch._scaled_mm on CPU tensors: nothing to decide
        return {"kernel": "the platform's own FP8 kernels", "probe_ratio": None, "reason": "not a CPU engine"}
    if getattr(torch._scaled_mm, "_hive_aot", False):  # a second job in a warm process: measure the real one
        torch._scaled_mm = torch._scaled_mm.original
    ratio = None if requested in ("native", "emulated") else round(probe_fp8_matmul(), 1)
    emulate = requested == "emulated" or (ratio is not None and ratio >= FP8_SLOW_RATIO)
    if emulate:
        torch._scaled_mm = emulated_scaled_mm(torch._scaled_mm)
    if requested != "auto":
        why = f"HIVE_AOT_VLLM_FP8_MATMUL={requested}"
    elif emulate:
        why = (f"torch._scaled_mm took {ratio}x the emulation's time here (oneDNN has no fast FP8 kernel for "
               "this CPU): the same products as an fp32 GEMM")
    else:
        why = f"torch._scaled_mm took {ratio}x the emulation's time on this CPU (under {FP8_SLOW_RATIO:g}x): kept"
    return {"kernel": "fp32 emulation of torch._scaled_mm" if emulate else "torch._scaled_mm", "probe_ratio": ratio,
            "reason": why}


def preload() -> None:
    """What every job imports first (most of an engine start on CPU): a warm server does it once."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    skip_input_embedding_packing()


def main(argv: list[str]) -> int:
    job_path, result_path = argv[1], argv[2]
    with open(job_path) as f:
        job = json.load(f)
    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    preload()
    fp8_matmul = choose_fp8_matmul(job["fp8_matmul"]) if job.get("fp8_matmul") else None

    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_model_len=job["max_model_len"], enforce_eager=True,
              seed=0, gpu_memory_utilization=job.get("memory_fraction", 0.25), trust_remote_code=False,
              distributed_executor_backend="uni",
              **job.get("engine_args", {}))
    t_load = time.time()

    # One sequence at a time: prompt logprobs cost [tokens x vocab] per sequence in flight (a 128k vocabulary's
    # for every parity text at once would be most of the engine's memory on a small model).
    scored = [llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
              for ids in job["sequences"]]
    sequences = []
    for ids, out in zip(job["sequences"], scored):
        rows = []
        for pos, entry in enumerate(out.prompt_logprobs or []):
            if entry is None:  # the first position has no prediction
                continue
            actual = ids[pos]
            top = min(entry.items(), key=lambda kv: kv[1].rank)
            rows.append([int(top[0]), float(top[1].logprob), float(entry[actual].logprob)])
        sequences.append(rows)

    generated = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["generation_prompts"]],
                             SamplingParams(temperature=0.0, max_tokens=job["generation_tokens"], logprobs=1,
                                            ignore_eos=True), use_tqdm=False)
    greedy = []
    for out in generated:
        c = out.outputs[0]
        greedy.append({"ids": [int(t) for t in c.token_ids],
                       "logprobs": [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs or [])]})

    tok = llm.get_tokenizer()
    tokenized = [list(tok(text).input_ids) for text in job["tokenizer_texts"]]
    result = {"sequences": sequences, "greedy": greedy, "tokenized": tokenized, "vllm": vllm.__version__,
              "load_seconds": round(t_load - t0, 1), "total_seconds": round(time.time() - t0, 1),
              **({"fp8_matmul": fp8_matmul} if fp8_matmul else {})}
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    import os

    os.replace(result_path + ".tmp", result_path)
    return 0


def fast_exit(rc: int) -> None:
    """Leave without vLLM's interpreter shutdown (atexit hooks, thread joins), which took 3-6 s after the result
    was on disk. Only in one-process mode (engine.py's default): with vLLM's engine processes on, its shutdown is
    what stops them, so the normal exit stays."""
    import os

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        sys.exit(rc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    try:
        code = main(sys.argv)
    except Exception:  # the traceback is the error engine.py reads (its root-cause line)
        import traceback

        traceback.print_exc()
        code = 1
    fast_exit(code)
