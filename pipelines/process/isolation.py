"""Run native engines (llama.cpp today; ONNX Runtime and vLLM later) in a child process.

A native engine that crashes (SIGILL from an instruction the CPU lacks, SIGSEGV, abort()) takes
its whole process with it. Run in a child, the crash becomes one error line in the parent that names
the engine, the signal and the step, and the build publishes nothing. The child is a fresh Python
interpreter (`python -m` of this module), not a fork of this process: forking a process that already
holds threads (Dagster, torch, tqdm) is unsafe, and a fresh interpreter also hands its memory back. With
HIVE_AOT_WARM_DIR set, the child is instead forked by a warm server (pipelines/process/warm.py), a process that has
only imported the engines' libraries (`PRELOAD`, `PRELOAD_TORCH`) and the modules of the functions its jobs ran
(`prepare`): the same isolation, without the imports.

Arguments and results cross as JSON files, never pickles. Exceptions raised in the child come back
as the same `HiveError` class with the same one-line message; anything else becomes an
`EngineFailed` line naming its type.

Fault injection for tests: `HIVE_AOT_FAULT=<step>:<SIGNAL>` makes the child of that step kill
itself with that signal just before calling the engine (`segv` dereferences NULL in native code).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any

from ..core import errors, meter, settings
from ..core.errors import EngineCrashed, EngineFailed, HiveError
from ..core.paths import work_dir
from . import warm

_SIGNAL_MEANING = {
    "SIGILL": "illegal instruction: the library uses CPU instructions this host lacks",
    "SIGSEGV": "segmentation fault",
    "SIGBUS": "bus error",
    "SIGFPE": "arithmetic exception",
    "SIGABRT": "aborted by the library",
    "SIGKILL": "killed, most often by the kernel for lack of memory",
}


def importable_name(function: Callable[..., Any]) -> str:
    """`package.module:name` of a module-level function, which the child imports. Callers pass the function itself,
    so the import graph (and a module's move) sees the edge a string would hide."""
    where = sys.modules.get(function.__module__)
    if getattr(where, function.__qualname__, None) is not function:
        raise TypeError(f"run_isolated runs module-level functions only, not {function.__module__}."
                        f"{function.__qualname__}")
    module = function.__module__
    if module == "__main__":  # `python -m pipelines.demo`: the child imports the module by its own name
        module = getattr(getattr(where, "__spec__", None), "name", None) or ""
        if not module:
            raise TypeError(f"run_isolated cannot import {function.__qualname__} from a script run by path")
    return f"{module}:{function.__qualname__}"


def run_isolated(function: Callable[..., Any], *, engine: str, step: str, usage: dict[str, int] | None = None,
                 needs_torch: bool = False, **kwargs: Any) -> Any:
    """Call the module-level `function(**kwargs)` in a child Python and return its JSON result.

    `engine` and `step` only name things in the error line, e.g. engine "llama.cpp", step
    "GGUF validation of org/name (gguf-q4_k_m)". `usage`, when given, receives the child's peak
    resident memory (`peak_rss`, which counts mapped file pages) and its anonymous memory at the end
    (`anon_rss`), in bytes. With HIVE_AOT_WARM_DIR set, a warm server (pipelines/process/warm.py) forks the child
    with its imports done: numpy, llama.cpp and hive-aot's engine modules, plus torch and transformers when
    `needs_torch` (seconds of imports a child that does not use them should not hold in memory).
    """
    with work_dir("isolated-") as work:
        request_path, result_path = work / "request.json", work / "result.json"
        request_path.write_text(json.dumps({"function": importable_name(function), "kwargs": kwargs, "result": str(result_path),
                                            "step": step}))
        returncode = _run_child(request_path, needs_torch)
        try:
            outcome = json.loads(result_path.read_text())
        except (OSError, ValueError):
            outcome = None
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        meaning = _SIGNAL_MEANING.get(sig, "killed by a signal")
        raise EngineCrashed(f"{engine} crashed with {sig} ({meaning}) during {step}; nothing was published")
    if outcome is None:
        raise EngineCrashed(f"{engine} exited with status {returncode} during {step} without a result; "
                            "nothing was published")
    meter.child((outcome.get("usage") or {}).get("peak_rss"))
    if usage is not None:
        usage.update(outcome.get("usage") or {})
    if "error" in outcome:
        err = outcome["error"]
        cls = getattr(errors, err["type"], None)
        if isinstance(cls, type) and issubclass(cls, HiveError):
            raise cls(err["message"])
        raise EngineFailed(f"{engine} failed during {step}: {err['type']}: {err['message']}")
    return outcome["value"]


def _run_child(request_path: Path, needs_torch: bool) -> int:
    """The child's exit status: forked by a warm server where one is available, else a fresh interpreter."""
    argv = ["-m", __spec__.name, str(request_path)]  # its own name, also when it runs as `python -m`
    done = warm.run(sys.executable, __spec__.name, argv, cwd=Path.cwd(), env=dict(os.environ), timeout=None,
                    preload="preload_torch" if needs_torch else "preload")
    if done is None:
        return subprocess.run([sys.executable, *argv], stdin=subprocess.DEVNULL).returncode
    return done[0]


# What a warm server imports when it starts (pipelines/process/warm.py): the engines' libraries, by name, since
# they are not dependencies of this module. hive-aot's own modules it learns from its jobs (`prepare`).
PRELOAD = ("numpy", "llama_cpp")
PRELOAD_TORCH = (*PRELOAD, "torch", "transformers", "transformers.activations")  # hub kernels, dynamo


def _import_all(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            import_module(name)
        except ImportError:  # a host without that extra: its children import what they can themselves
            pass


def preload() -> None:
    """A warm server's imports: what every engine child spends its first second on."""
    _import_all(PRELOAD)


def preload_torch() -> None:
    """A needs_torch child's imports: torch and transformers too, several seconds on two cores."""
    _import_all(PRELOAD_TORCH)


def prepare(argv: list[str]) -> None:
    """In a warm server, before it forks a job: import the module of the job's function, so that this job and
    every later one of that function start with it (and what it imports) done, which a list of names kept here
    would do only for the modules someone remembered to list."""
    function = json.loads(Path(argv[-1]).read_text())["function"]
    import_module(function.partition(":")[0])  # raising, it leaves the child to import it and say what went wrong


def main(argv: list[str]) -> int:
    """A warm child's entry: argv as a fresh one gets it (`-m <this module> REQUEST`)."""
    return _child(argv[-1])


def run_measured(argv: list[str], timeout: float | None = None, **popen: Any) -> tuple[int, int]:
    """Run a child process to its end (or kill its process group at `timeout`: TimeoutExpired) and return
    (its exit status as subprocess gives it, its peak resident set in bytes from wait4's rusage). The peak is
    credited to the current build step (meter.py)."""
    import threading

    proc = subprocess.Popen(argv, **popen)
    outcome: dict[str, Any] = {}

    def reap() -> None:
        _pid, status, usage = os.wait4(proc.pid, 0)
        outcome["status"], outcome["peak"] = status, usage.ru_maxrss * 1024

    waiter = threading.Thread(target=reap, daemon=True)
    waiter.start()
    waiter.join(timeout)
    if waiter.is_alive():
        try:
            os.killpg(proc.pid, signal.SIGKILL) if popen.get("start_new_session") else proc.kill()
        except ProcessLookupError:
            pass
        waiter.join()
        raise subprocess.TimeoutExpired(argv, timeout or 0)
    proc.returncode = os.waitstatus_to_exitcode(outcome["status"])
    meter.child(outcome["peak"])
    return proc.returncode, outcome["peak"]


def peak_memory() -> dict[str, int]:
    """This process's peak resident set (VmHWM, which counts mapped file pages) and current anonymous
    resident memory, in bytes; empty where /proc is not there."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon"):
                out["peak_rss" if key == "VmHWM" else "anon_rss"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _inject_fault(step: str) -> None:
    spec = settings.FAULT.get() or ""
    where, _, what = spec.rpartition(":")
    if not where or where not in step:
        return
    if what.lower() == "segv":
        import ctypes

        ctypes.string_at(0)  # a real invalid read in native code
    os.kill(os.getpid(), signal.Signals[what.upper()])


def _child(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    module, _, name = request["function"].partition(":")
    try:
        func = getattr(import_module(module), name)
        _inject_fault(request["step"])
        text, rc = json.dumps({"value": func(**request["kwargs"])}), 0
    except HiveError as e:
        text, rc = json.dumps({"error": {"type": type(e).__name__, "message": str(e)}}), 1
    except OSError as e:
        from ..core.host import disk_full_error, is_disk_full

        if is_disk_full(e):  # the same DiskFull line (exit 7) as a full disk in the parent
            err = disk_full_error(e.errno, Path(e.filename).parent if e.filename else Path(request["result"]).parent,
                                  subject=request["step"])
            text, rc = json.dumps({"error": {"type": "DiskFull", "message": str(err)}}), 1
        else:
            text, rc = json.dumps({"error": {"type": type(e).__name__, "message": " ".join(str(e).split())}}), 1
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        text, rc = json.dumps({"error": {"type": type(e).__name__, "message": " ".join(str(e).split())}}), 1
    text = text[:-1] + f', "usage": {json.dumps(peak_memory())}}}'
    # Written whole and renamed: the parent never reads half a result.
    tmp = request["result"] + ".tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, request["result"])
    return rc


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
