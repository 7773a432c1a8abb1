"""`make demo`: onboard the demo model through Dagster (GGUF and prepared vLLM weights, each validated in
its engine), pull the q4_k_m artifact, generate.

Runs fully offline on the embedded defaults: the local store ./artifacts and the SQLite Dagster
instance in ./.dagster (the Makefile sets both explicitly, whatever the shell exports). A second run
rebuilds nothing (every build id is already published).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .core import settings
from .core.units import human_bytes

DEMO_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_RECIPE = "gguf-q4_k_m"
PROMPT = "The capital of France is"


def greedy_completion(model_path: str, prompt: str, max_tokens: int) -> str:
    """llama.cpp greedy decoding; runs in a child process (pipelines.process.isolation)."""
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, n_ctx=256, verbose=False, seed=0)
    try:
        return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()


def main() -> int:
    from .client.pull import pull
    from .core.errors import HiveError
    from .orchestration.onboard import onboard
    from .process.isolation import run_isolated
    from .store import default_store_uri
    from .validation.quality_view import engine_check

    print(f"demo: store {default_store_uri()}, Dagster instance {settings.DAGSTER_HOME.get() or './.dagster'}",
          file=sys.stderr)
    report = onboard(models=[DEMO_MODEL])
    rows = report.results
    print(f"\n{'recipe':14} {'size':>10} {'top-1':>7} {'KL':>9} {'engine (vLLM fp32 / AI 100 emulated)':38} "
          f"{'build id':14} {'skipped?':8} state")
    for r in rows:
        chk = r.check
        top1 = f"{chk['top1_agreement']:.4f}" if "top1_agreement" in chk else "-"
        kl = f"{chk['mean_kl']:.5f}" if "mean_kl" in chk else "-"
        size = human_bytes(r.size) if r.size is not None else "-"  # the units every command prints
        skipped = "yes" if r.skipped or r.state == "skipped" else "no"
        print(f"{r.recipe:14} {size:>10} {top1:>7} {kl:>9} {engine_check(chk):38} {r.build_id[:12]:14} "
              f"{skipped:8} {r.state}" + (f" ({r.error})" if r.error else ""))
    if not report.success:
        print("demo: onboarding failed (see above)", file=sys.stderr)
        return 1

    dest = Path("pulled") / DEMO_MODEL.split("/")[1]
    res = pull(DEMO_MODEL, "llm-llamacpp-cpu", dest, recipe=DEMO_RECIPE)
    print(f"\npulled {res.recipe} build {res.build_id[:12]} into {res.dest}")
    try:
        text = run_isolated(greedy_completion, engine="llama.cpp", step="the demo's generation",
                            model_path=res.files[0], prompt=PROMPT, max_tokens=16)
    except HiveError as e:
        print(f"demo: {e}", file=sys.stderr)
        return e.exit_code
    print(f"llama.cpp greedy from the pulled file: {PROMPT!r} -> {text!r}")
    print(f"serve it: {res.serve}")
    print(f"\nDagster UI with these runs: make ui   (DAGSTER_HOME={report.dagster_home})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
