"""hive-aot's CLI with step markers, for bench/large_model.py.

    python bench/cli_trace.py TRACE_FILE build SOURCE --recipe R ...

Runs `pipelines.cli.main:main` (the function `.venv/bin/hive-aot` calls) with the same arguments, in a process
that first wraps a few pipeline functions to write one JSON line per step boundary to TRACE_FILE:

    {"t": <time.time()>, "ev": "begin"|"end"|"child"|"exit", "step": <label>, "stack": [...],
     "seg_hwm_kb": <peak RSS of this process since the previous line>, "rss_kb": ..., "cg_max": ...}

At every line the process reads its own VmHWM (the exact peak RSS of the segment that just ended) and
resets it (`/proc/self/clear_refs` = 5), and, when `HIVE_BENCH_CGROUP` names a memory cgroup (v1),
reads and resets its `memory.max_usage_in_bytes` the same way. The native engines' child processes
(pipelines/process/isolation.py) are waited for with `os.wait4`, whose rusage gives each child's exact peak
RSS ("child" lines). A wrapped function that no longer exists (the pipeline changed) is reported in
the first line and its time counts towards the enclosing step.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_TRACE = None
_STACK: list[str] = []
_CGROUP = os.environ.get("HIVE_BENCH_CGROUP")


def _status_kb(field: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _cgroup_read(name: str) -> int | None:
    try:
        return int(Path(_CGROUP, name).read_text().split()[0]) if _CGROUP else None
    except (OSError, ValueError, IndexError):
        return None


def event(kind: str, step: str, **extra) -> None:
    rec = {"t": time.time(), "ev": kind, "step": step, "stack": list(_STACK), "seg_hwm_kb": _status_kb("VmHWM"),
           "rss_kb": _status_kb("VmRSS"), **extra}
    try:
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := current RSS
            f.write("5")
    except OSError:
        rec["hwm_reset"] = False
    if _CGROUP:
        rec["cg_max"] = _cgroup_read("memory.max_usage_in_bytes")
        rec["cg_failcnt"] = _cgroup_read("memory.failcnt")
        try:
            Path(_CGROUP, "memory.max_usage_in_bytes").write_text("0")
        except OSError:
            pass
    _TRACE.write(json.dumps(rec) + "\n")
    _TRACE.flush()


def _wrap(module: str, attr: str, label, missing: list[str]) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        missing.append(f"{module}.{attr}")
        return
    orig = getattr(mod, attr, None)
    if orig is None or getattr(orig, "_bench_wrapped", False):
        if orig is None:
            missing.append(f"{module}.{attr}")
        return

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        name = label(args, kwargs) if callable(label) else label
        event("begin", name)
        _STACK.append(name)
        try:
            return orig(*args, **kwargs)
        finally:
            _STACK.pop()
            event("end", name)

    wrapper._bench_wrapped = True
    setattr(mod, attr, wrapper)


def child_step(function: str) -> str:
    """The step a native child belongs to, from the `module:function` pipelines.process.isolation runs in it."""
    if "quantize" in function:
        return "quantize"
    if "reference" in function:
        return "reference"
    if "validate" in function or "llama" in function:
        return "llama.cpp eval"
    return f"child {function.rpartition(':')[2] or function}"


def _isolated_label(args, kwargs) -> str:
    return child_step(str(args[0] if args else kwargs.get("function", "")))


class _SubprocessShim:
    """`subprocess` for pipelines.process.isolation, whose `run` waits with os.wait4 to get the child's rusage."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def run(args, **kwargs):
        plain = {k: v for k, v in kwargs.items() if k in ("stdin", "env", "cwd")}
        if plain != kwargs:  # pipes or timeouts: not ours to reimplement
            return subprocess.run(args, **kwargs)
        t0 = time.time()
        proc = subprocess.Popen(args, **plain)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        function = None
        try:
            function = json.loads(Path(args[-1]).read_text()).get("function")
        except (OSError, ValueError, AttributeError):
            pass
        event("child", _STACK[-1] if _STACK else "cli", pid=proc.pid, child_maxrss_kb=usage.ru_maxrss,
              child_wall_s=round(time.time() - t0, 3), child_rc=proc.returncode, function=function)
        return subprocess.CompletedProcess(args, proc.returncode)


def install() -> list[str]:
    missing: list[str] = []
    _wrap("pipelines.engine.build", "fetch", "fetch + sha256", missing)
    _wrap("pipelines.engine.build", "stage", "stage: hash + store upload", missing)
    _wrap("pipelines.targets.gguf.convert", "convert", "convert", missing)
    _wrap("pipelines.targets.gguf.quantize", "quantize", "quantize", missing)
    _wrap("pipelines.engine.build", "validate_staged", "validate: compare + other", missing)
    _wrap("pipelines.engine.build", "materialize_blobs", "validate: materialize", missing)
    _wrap("pipelines.validation.reference", "load_tokenizer", "load tokenizer", missing)
    _wrap("pipelines.validation.reference", "compute", "reference", missing)
    _wrap("pipelines.process.isolation", "run_isolated", _isolated_label, missing)
    _wrap("pipelines.engine.build", "publish_staged", "publish", missing)
    try:
        iso = importlib.import_module("pipelines.process.isolation")
        if getattr(iso, "subprocess", None) is subprocess:
            iso.subprocess = _SubprocessShim()
        else:
            missing.append("pipelines.process.isolation.subprocess")
    except ImportError:
        missing.append("pipelines.process.isolation")
    return missing


def main() -> int:
    global _TRACE
    trace_path, argv = sys.argv[1], sys.argv[2:]
    _TRACE = open(trace_path, "a", buffering=1)
    event("start", "cli", argv=argv)
    missing = install()
    event("hooks", "cli", missing=missing)
    from pipelines.cli.main import main as cli_main

    rc = 1
    try:
        rc = cli_main(argv)
    finally:
        event("exit", "cli", rc=rc)
        _TRACE.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
