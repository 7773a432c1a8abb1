"""vLLM's side of validating a prepared directory. Runs as a script in the vLLM venv (`make setup`
creates it), never imported by hive-aot: that venv has vLLM and its own torch/transformers, not hive-aot.

    python runner.py JOB.json RESULT.json

JOB: model_dir, dtype, max_model_len, sequences (token ids, scored teacher-forced through
prompt_logprobs), generation_prompts (token ids, greedy), generation_tokens, tokenizer_texts.
RESULT: per sequence and position [top-1 id, top-1 logprob, logprob of the actual next token];
greedy token ids with their logprobs; the ids vLLM's tokenizer gives the texts; versions and timings.

A script file, not stdin: vLLM's engine start spawns processes that re-import the main module. A warm
server (pipelines/warm.py) runs it too: `preload()` once, then `main(argv)` in a forked child per job.
"""

import json
import sys
import time


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
              "load_seconds": round(t_load - t0, 1), "total_seconds": round(time.time() - t0, 1)}
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
