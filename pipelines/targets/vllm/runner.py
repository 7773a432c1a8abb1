"""vLLM's side of validating a prepared directory. Runs as a script in the vLLM venv (`make setup`
creates it), never imported by hive-aot: that venv has vLLM and its own torch/transformers, not hive-aot.

    python runner.py JOB.json RESULT.json

JOB: model_dir, dtype, max_model_len, sequences (token ids, scored teacher-forced through
prompt_logprobs), generation_prompts (token ids, greedy), generation_tokens, tokenizer_texts.
RESULT: per sequence and position [top-1 id, top-1 logprob, logprob of the actual next token];
greedy token ids with their logprobs; the ids vLLM's tokenizer gives the texts; versions and timings.

A script file, not stdin: vLLM's engine start spawns processes that re-import the main module.
"""

import json
import sys
import time


def main() -> int:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_model_len=job["max_model_len"], enforce_eager=True,
              seed=0, gpu_memory_utilization=job.get("memory_fraction", 0.25), trust_remote_code=False,
              distributed_executor_backend="uni",
              **job.get("engine_args", {}))
    t_load = time.time()

    scored = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["sequences"]],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
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


if __name__ == "__main__":
    sys.exit(main())
