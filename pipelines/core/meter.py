"""What each build step really used, beside what the memory plan estimated for it.

A step is entered with `with step("validate"):`. Steps nest; each one's measurement is exclusive (a step
nested in it is measured on its own, as the plan counts it on its own). Measured per step:

- this process's peak resident set over the step's own segments (VmHWM, reset through
  `/proc/self/clear_refs` at every boundary, so it is exact per segment; it counts mapped file pages too);
- the peak resident set of each child process the step ran (isolated engines, the vLLM runner), reported
  by `child(peak)` when it ends, plus this process's resident set at that moment (it waited for the child,
  so that is what it held meanwhile).

The step's figure is the larger of the two: what its processes held together at the worst moment. Wall time
is kept per step the same way (exclusive of the steps nested in it).

The build records `{step: bytes}` next to its plan (`BuildResult.memory_measured`), so every build checks
its plan and a test can hold the plan to within a factor of what was measured. Where /proc cannot be
read or reset (not Linux), nothing is recorded.

A step may also be credited with the work it did (`work`: floating-point operations of a forward pass, bytes
read or written); with its own wall time that gives the rate it achieved (`rates`), which the build records
beside its times and the bench compares with the host's floor (the GEMM rate, a copy).

Each step is also reported as it starts and ends (progress.py: a line on stderr and in the run log), with its
own elapsed time and peak (and rate, when credited with work), nested steps included. A step may be shown
under another `label` than the plan step it is measured as: the blob upload is part of the plan's `publish`
step, and shown as `upload`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import progress


@dataclass
class _Entered:
    """One step while it runs: what its report says when it ends (the steps nested in it included)."""
    name: str
    label: str
    started: float
    peak: int = 0
    work: dict[str, float] = field(default_factory=dict)  # unit ("flop", "bytes") -> amount done inside this step


_lock = threading.Lock()
_stack: list[_Entered] = []
_own: dict[str, int] = {}  # step -> this process's peak over its segments
_children: dict[str, int] = {}  # step -> the largest (child's peak + this process's resident set meanwhile)
_seconds: dict[str, float] = {}  # step -> wall time of its own segments
_work: dict[str, dict[str, float]] = {}  # step -> unit -> amount of work credited to it (`work`)
_segment_start = [time.monotonic()]


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _close_segment() -> None:
    """Credit the peak since the last boundary to the step on top, and start a new segment."""
    peak = _status_bytes("VmHWM")
    now = time.monotonic()
    if _stack:
        top = _stack[-1].name
        _seconds[top] = _seconds.get(top, 0.0) + now - _segment_start[0]
        if peak is not None:
            _own[top] = max(_own.get(top, 0), peak)
            _raise_reported_peaks(peak)
    _segment_start[0] = now
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current resident set
    except OSError:
        pass


def _raise_reported_peaks(held: int) -> None:
    for entered in _stack:  # a report covers the steps nested in it
        entered.peak = max(entered.peak, held)


@contextmanager
def step(name: str, label: str | None = None) -> Iterator[None]:
    """Measure what runs inside as plan step `name`, and report it (as `label`, else `name`)."""
    entered = _Entered(name, label or name, time.monotonic())
    with _lock:
        _close_segment()
        _stack.append(entered)
    progress.step_started(entered.label)
    failed = True
    try:
        yield
        failed = False
    finally:
        with _lock:
            _close_segment()
            _stack.pop()
        progress.step_ended(entered.label, time.monotonic() - entered.started, entered.peak or None, failed,
                            entered.work)


def child(peak_bytes: int | None) -> None:
    """A child process of the current step ended, having peaked at `peak_bytes` resident."""
    if not peak_bytes:
        return
    waiting = _status_bytes("VmRSS") or 0
    with _lock:
        if _stack:
            top = _stack[-1].name
            _children[top] = max(_children.get(top, 0), int(peak_bytes) + waiting)
            _raise_reported_peaks(int(peak_bytes) + waiting)


def work(flop: float = 0, nbytes: float = 0) -> None:
    """Credit the step running now with work it did: floating-point operations, bytes moved."""
    with _lock:
        if not _stack:
            return
        for unit, amount in (("flop", flop), ("bytes", nbytes)):
            if amount > 0:
                for credited in (_work.setdefault(_stack[-1].name, {}), _stack[-1].work):
                    credited[unit] = credited.get(unit, 0.0) + float(amount)


def reset() -> None:
    """Forget what was measured (a build starts a new record)."""
    with _lock:
        _own.clear()
        _children.clear()
        _seconds.clear()
        _work.clear()


def measured() -> dict[str, int]:
    """{step: the most its processes held together}, for the steps run since the last reset."""
    with _lock:
        _close_segment()
        return {s: max(_own.get(s, 0), _children.get(s, 0)) for s in sorted(set(_own) | set(_children))}


def seconds() -> dict[str, float]:
    """{step: wall seconds of its own}, for the steps run since the last reset."""
    with _lock:
        _close_segment()
        return {s: round(v, 1) for s, v in sorted(_seconds.items())}


def rates() -> dict[str, dict[str, float]]:
    """{step: {unit: amount, unit_per_s: amount over the step's own wall time}} for the steps credited with work
    since the last reset (flop_per_s of a reference pass, bytes_per_s of a conversion)."""
    with _lock:
        _close_segment()
        out: dict[str, dict[str, float]] = {}
        for step, done in sorted(_work.items()):
            secs = _seconds.get(step, 0.0)
            out[step] = {k: v for unit, amount in sorted(done.items())
                         for k, v in ((unit, amount), (f"{unit}_per_s", round(amount / secs) if secs > 0 else 0))}
        return out
