"""`make demo`: onboard the registry's models through Dagster, pull the q4_k_m artifact, generate.

Runs fully offline on the embedded defaults: the local store ./artifacts and the SQLite Dagster
instance in ./.dagster. A second run rebuilds nothing (every build id is already published).
"""

from __future__ import annotations

import sys
from pathlib import Path

DEMO_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_RECIPE = "gguf-q4_k_m"
PROMPT = "The capital of France is"


def main() -> int:
    from .orchestration.onboard import onboard
    from .pull import pull

    report = onboard(models=[DEMO_MODEL])
    rows = report["results"]
    print(f"\n{'recipe':14} {'size':>10} {'top-1':>7} {'KL':>9} {'build id':14} {'skipped?':8} state")
    for r in rows:
        chk = r.get("check", {})
        top1 = f"{chk['top1_agreement']:.4f}" if "top1_agreement" in chk else "-"
        kl = f"{chk['mean_kl']:.5f}" if "mean_kl" in chk else "-"
        size = f"{r['size'] / 1e6:.1f} MB" if "size" in r else "-"
        skipped = "yes" if r["state"] == "skipped" else "no"
        print(f"{r['recipe']:14} {size:>10} {top1:>7} {kl:>9} {r.get('build_id', '')[:12]:14} {skipped:8} {r['state']}"
              + (f" ({r['error']})" if r.get("error") else ""))
    if not report["success"]:
        print("demo: onboarding failed (see above)", file=sys.stderr)
        return 1

    dest = Path("pulled") / DEMO_MODEL.split("/")[1]
    res = pull(DEMO_MODEL, "llm-llamacpp-cpu", dest, recipe=DEMO_RECIPE)
    print(f"\npulled {res['recipe']} build {res['build_id'][:12]} into {res['dest']}")
    from llama_cpp import Llama

    llm = Llama(model_path=res["files"][0], n_ctx=256, verbose=False, seed=0)
    out = llm.create_completion(PROMPT, max_tokens=16, temperature=0.0)
    llm.close()
    print(f"llama.cpp greedy from the pulled file: {PROMPT!r} -> {out['choices'][0]['text']!r}")
    print(f"serve it: {res['serve']}")
    print(f"\nDagster UI with these runs: make ui   (DAGSTER_HOME={report['dagster_home']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
