"""What a running build tells its operator on stderr (never stdout, which `--json` reserves).

- Step lines: every build step (meter.step) says when it starts and when it ends, with its elapsed time and the
  peak memory its processes held, e.g. `hive-aot: [gguf-q8_0: reference] done in 12.3 s, peak 1.4 GiB` (a step
  that raised: `failed after ...`). What a CI log, `| tee` or a Dagster run log needs; the same lines go to the
  Python logger `hive_aot.progress`, which orchestration forwards into each run's log.
- Bars: tqdm with an ETA for the long steps, on a terminal only (HIVE_AOT_PROGRESS forces them elsewhere). The
  step lines go around them through tqdm.write, so a bar is never torn by a line.

HIVE_AOT_QUIET (`--quiet`) silences both on stderr; the logger still gets the lines. Settings are read when asked
for, so an isolated child (which inherits the environment) reports as its parent does.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tqdm import tqdm

from . import settings
from .units import human_bytes

LOG = logging.getLogger("hive_aot.progress")
LOG.setLevel(logging.INFO)
# Its readers attach to it (orchestration forwards it into Dagster's run log); an application's root handlers
# would print every line a second time beside the one on stderr.
LOG.propagate = False

_subject: ContextVar[str | None] = ContextVar("hive_aot_progress_subject", default=None)


def quiet() -> bool:
    return settings.QUIET.is_set()


def bars_shown() -> bool:
    """Whether bars are drawn: on a terminal, or forced by HIVE_AOT_PROGRESS; never when quiet."""
    return not quiet() and (settings.PROGRESS.is_set() or sys.stderr.isatty())


def bar(total: int | None = None, desc: str = "", unit: str = "B") -> tqdm:
    disable = True if quiet() else None if not settings.PROGRESS.is_set() else False  # None = auto (TTY only)
    scale = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
                file=sys.stderr, disable=disable, leave=False, dynamic_ncols=True)


@contextmanager
def silenced() -> Iterator[None]:
    """Quiet for what runs inside (`--quiet`): through the environment, so isolated children are quiet too."""
    before = settings.QUIET.raw()
    os.environ[settings.QUIET.name] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[settings.QUIET.name]
        else:
            os.environ[settings.QUIET.name] = before


@contextmanager
def subject(text: str) -> Iterator[None]:
    """Name what the steps inside belong to (a recipe of a chain): `[gguf-q8_0: convert]`."""
    token = _subject.set(text)
    try:
        yield
    finally:
        _subject.reset(token)


def _say(message: str) -> None:
    LOG.info(message)
    if not quiet():
        tqdm.write(f"hive-aot: {message}", file=sys.stderr)  # clears and redraws any bar on stderr


def _name(label: str) -> str:
    owner = _subject.get()
    return f"[{owner}: {label}]" if owner else f"[{label}]"


def step_started(label: str) -> None:
    _say(f"{_name(label)} start")


def step_ended(label: str, seconds: float, peak_bytes: int | None, failed: bool,
               work: dict[str, float] | None = None) -> None:
    how = "failed after" if failed else "done in"
    peak = f", peak {human_bytes(peak_bytes)}" if peak_bytes else ""
    _say(f"{_name(label)} {how} {seconds:.1f} s{peak}{_rates(work or {}, seconds)}")


def _rates(work: dict[str, float], seconds: float) -> str:
    """", 212 GFLOP/s", ", 1.2 GiB/s": the work a step was credited with (meter.work) over its elapsed time."""
    if seconds <= 0:
        return ""
    shown = []
    if work.get("flop"):
        shown.append(f"{work['flop'] / seconds / 1e9:.1f} GFLOP/s")
    if work.get("bytes"):
        shown.append(f"{human_bytes(int(work['bytes'] / seconds))}/s")
    return "".join(f", {x}" for x in shown)


@contextmanager
def unit_runs(modules: list, passes: int, desc: str) -> Iterator[None]:
    """A bar over `passes` passes through `modules` (a streamed model's units, torch modules): one tick each time
    one of them runs forward. The natural counter of a reference or calibration pass, which reads one unit at a
    time."""
    with bar(passes * len(modules), desc, unit="unit") as pb:
        def tick(_module, _args, _output) -> None:  # None: a forward hook's value would replace the output
            pb.update()

        hooks = [module.register_forward_hook(tick) for module in modules]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
