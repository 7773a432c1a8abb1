"""One cold start of vLLM on a directory, then greedy continuations (bench/gpu_vllm.sh runs it per directory)."""

import json
import sys
import time

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village by the sea,"]


def main() -> None:
    path = sys.argv[1]
    t0 = time.time()
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", max_model_len=2048, seed=0, gpu_memory_utilization=0.5)
    cold = time.time() - t0
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"dir": path, "cold_start_s": round(cold, 1),
                      "greedy": [list(o.outputs[0].token_ids) for o in outs],
                      "text": [o.outputs[0].text for o in outs]}))


if __name__ == "__main__":
    main()
