"""vLLM's side of validating a prepared directory. Runs as a script in the vLLM venv (`make setup`
creates it), never imported by hive-aot: that venv has vLLM and its own torch/transformers, not hive-aot.

    python runner.py JOB.json RESULT.json

JOB: model_dir, dtype, max_model_len, sequences (token ids, scored teacher-forced through
prompt_logprobs), generation_prompts (token ids, greedy), generation_tokens, tokenizer_texts; for a
vision-language model image_prompts (text and a picture to draw, vision.py).
RESULT: per sequence and position [top-1 id, top-1 logprob, logprob of the actual next token];
greedy token ids with their logprobs; the ids vLLM's tokenizer gives the texts; versions and timings;
for an FP8 artifact, which FP8 matmul ran (`fp8_matmul`, below); per image prompt its text, vLLM's ids and
rows, and the HF processor's tensors for it.

A script file, not stdin: vLLM's engine start spawns processes that re-import the main module. A warm
server (pipelines/process/warm.py) runs it too: `preload()` once, then `main(argv)` in a forked child per job.
"""

import json
import sys
import time
import weakref


def defer_input_embedding_packing() -> None:
    """vLLM's CPU backend gives every vocab-parallel layer a oneDNN matmul handle holding a packed copy of its
    weight, the input embedding included, which usually only gathers rows: a vocabulary x hidden copy nothing
    uses (4 GiB at 70B in fp32). The input embedding keeps its weight and is packed on its first matmul instead:
    a model that computes its logits through the input embedding itself (Cohere, Cohere2, Gemma-2 pass
    `embed_tokens` to the logits processor) gets the handle vLLM would have made, at the first logits; any other
    model never builds it. A head (and a head tied to the embedding) is packed as vLLM does. Where the layout of
    vLLM's modules differs, nothing is changed."""
    try:
        from vllm.model_executor.layers import vocab_parallel_embedding as vpe
    except ImportError:
        return
    method = getattr(vpe, "UnquantizedEmbeddingMethod", None)
    original = getattr(method, "process_weights_after_loading", None)
    if original is None or getattr(original, "_hive_aot", False):
        return

    def process_weights_after_loading(self, layer):
        if type(layer) is not vpe.VocabParallelEmbedding:  # a (subclassed) head: packed now
            return original(self, layer)
        layer.cpu_linear = pack_on_first_matmul(lambda: original(self, layer), layer)
        return None

    process_weights_after_loading._hive_aot = True
    method.process_weights_after_loading = process_weights_after_loading


def pack_on_first_matmul(pack, layer):
    """A stand-in for `layer.cpu_linear` that runs vLLM's packing (`pack`, which sets the real `cpu_linear`) the
    first time the layer is used as a matmul, then that handle for this call and every later one."""

    def first_matmul(x, weight, bias):
        pack()
        if layer.cpu_linear is first_matmul:  # the platform set no handle: the plain matmul vLLM falls back to
            import torch

            return torch.nn.functional.linear(x, weight, bias)
        return layer.cpu_linear(x, weight, bias)

    return first_matmul


def flatten_rope_heads() -> None:
    """engine_defects.py `cpu_rope_three_dimensional_query`: vLLM 0.32's CPU rotary kernel reads a query given as
    [tokens, heads, head_dim] as tokens x heads rows of one head, row r rotated by positions[r]. The same values as
    [tokens, heads x head_dim] are rotated per head and position; the caller gets its own shape back."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "_hive_aot", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if query.dim() != 3:
            return original(self, positions, query, key)
        flat_key = None if key is None else key.reshape(key.shape[0], -1)
        q, k = original(self, positions, query.reshape(query.shape[0], -1), flat_key)
        return q.view(query.shape), None if k is None else k.view(key.shape)

    forward_cpu._hive_aot = True
    RotaryEmbedding.forward_cpu = forward_cpu


def route_with_correction_bias() -> None:
    """engine_defects.py `cpu_router_drops_correction_bias`: vLLM 0.32's CPU MoE router (CPURouter) handles an
    expert-score correction bias only inside grouped top-k; ungrouped softmax routing (ERNIE-4.5-MoE) takes the
    top-k of the raw logits without it, and ungrouped sigmoid routing (MiniMax-M2) stops at an assert. GPU vLLM
    passes the bias to its top-k kernel: experts chosen by score + bias, weighted by the unbiased scores,
    renormalized, times routed_scaling_factor. The CPU router does the same here; every other case is unchanged."""
    import torch
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    original = CPURouter._compute_routing
    if getattr(original, "_hive_aot", False):
        return

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if (self.use_grouped_topk or self.e_score_correction_bias is None or self.custom_routing_function is not None
                or self.scoring_func not in ("softmax", "sigmoid")):
            return original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        logits = router_logits.float()
        scores = torch.softmax(logits, dim=-1) if self.scoring_func == "softmax" else logits.sigmoid()
        ids = torch.topk(scores + self.e_score_correction_bias.float().unsqueeze(0), self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        # cpu_fused_moe reads routing tensors as contiguous float32 / int32 buffers
        return weights.to(torch.float32).contiguous(), ids.to(torch.int32).contiguous()

    _compute_routing._hive_aot = True
    CPURouter._compute_routing = _compute_routing


# Workarounds a job asks for by name (its `runner_patches`, from engine_defects.py for that engine build)
PATCHES = {"flatten_rope_heads": flatten_rope_heads, "route_with_correction_bias": route_with_correction_bias}


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


def fp32_attention(dtype: str) -> dict:
    """vLLM 0.32's CPU platform picks its AMX MLA backend on any AMX host whatever the model's dtype, and that
    backend packs bf16/fp16 weights only (fp32: "expect weight to be bfloat16, float16, int8, ..." at load, an
    engine bug); the validation runs fp32, so it asks for the reference CPU MLA backend, which non-MLA models
    ignore (they keep CPU attention)."""
    if dtype != "float32" or not _cpu_engine():
        return {}
    return {"attention_config": {"backend": "CPU_MLA"}}


# Prefix caching off: each parity sequence is scored from scratch, and vLLM 0.32's CPU Mamba-2 kernel returns only
# the final state where prefix caching asks for chunk checkpoints (Nemotron-H: "IndexError: index 8 is out of
# bounds for dimension 0 with size 1" on any prompt longer than a chunk).
VALIDATION_ENGINE_ARGS = {"enable_prefix_caching": False}


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


def prompt_rows(ids: list, prompt_logprobs) -> list:
    """[top-1 id, its logprob, the logprob of the actual next token] for each prompt position that predicts one."""
    rows = []
    for pos, entry in enumerate(prompt_logprobs or []):
        if entry is None:  # the first position has no prediction
            continue
        top = min(entry.items(), key=lambda kv: kv[1].rank)
        rows.append([int(top[0]), float(top[1].logprob), float(entry[ids[pos]].logprob)])
    return rows


def synthetic_image(spec: dict):
    """The image check's picture (vision.IMAGE_PROMPTS): colour gradients under seeded noise, so every region and
    channel differs and a processor's resizing, cropping and normalization all show in what the model reads."""
    import numpy as np
    from PIL import Image

    h, w = spec["height"], spec["width"]
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 255 / max(w + h - 2, 1)], axis=-1)
    noise = np.random.default_rng(spec["seed"]).normal(0.0, 24.0, base.shape)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def encode_array(a) -> dict:
    import base64

    import numpy as np

    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def score_image_prompts(llm, job: dict, SamplingParams) -> list:  # noqa: N803 - it receives vLLM's SamplingParams class
    """Each of the job's image prompts (vision.py): the model's image placeholder as vLLM's chat front end writes it
    for this model class, then the text; scored teacher-forced with the picture as `multi_modal_data`. Beside vLLM's
    ids and rows: what the model's HF processor (the one vLLM runs) makes of the same prompt and picture, every
    tensor, so that transformers runs exactly these inputs."""
    if not job.get("image_prompts"):
        return []
    from transformers import AutoProcessor
    from vllm.model_executor.models import ModelRegistry

    config = llm.llm_engine.model_config
    model_class, _arch = ModelRegistry.resolve_model_cls(config.architectures, config)
    placeholder = model_class.get_placeholder_str("image", 0)
    processor = AutoProcessor.from_pretrained(job["model_dir"], trust_remote_code=False, local_files_only=True)
    out = []
    for entry in job["image_prompts"]:
        image = synthetic_image(entry["image"])
        prompt = f"{placeholder}\n{entry['text']}"
        processed = processor(text=[prompt], images=[image], return_tensors="np")
        scored = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}],
                              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        ids = [int(t) for t in scored.prompt_token_ids]
        out.append({"prompt": prompt, "ids": ids, "rows": prompt_rows(ids, scored.prompt_logprobs),
                    "processor": type(processor).__name__,
                    "inputs": {k: encode_array(v) for k, v in processed.items() if hasattr(v, "shape")}})
    return out


def preload() -> None:
    """What every job imports first (most of an engine start on CPU): a warm server does it once."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    defer_input_embedding_packing()


def main(argv: list[str]) -> int:
    job_path, result_path = argv[1], argv[2]
    with open(job_path) as f:
        job = json.load(f)
    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    preload()
    for name in job.get("runner_patches", []):
        PATCHES[name]()
    fp8_matmul = choose_fp8_matmul(job["fp8_matmul"]) if job.get("fp8_matmul") else None

    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_model_len=job["max_model_len"], enforce_eager=True,
              seed=0, gpu_memory_utilization=job.get("memory_fraction", 0.25), trust_remote_code=False,
              distributed_executor_backend="uni",
              **{**VALIDATION_ENGINE_ARGS, **fp32_attention(job["dtype"]), **job.get("engine_args", {})})
    t_load = time.time()

    # One sequence at a time: prompt logprobs cost [tokens x vocab] per sequence in flight (a 128k vocabulary's
    # for every parity text at once would be most of the engine's memory on a small model).
    scored = [llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
              for ids in job["sequences"]]
    sequences = [prompt_rows(ids, out.prompt_logprobs) for ids, out in zip(job["sequences"], scored)]
    images = score_image_prompts(llm, job, SamplingParams)

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
              **({"image_prompts": images} if images else {}),
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
    except Exception:  # noqa: BLE001 - the traceback is the error engine.py reads (its root-cause line)
        import traceback

        traceback.print_exc()
        code = 1
    fast_exit(code)
