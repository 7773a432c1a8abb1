"""The engine's step lines in each Dagster run's log.

Every build step says when it starts and ends (`[gguf-q8_0: reference] done in 12.3 s, peak 1.4 GiB`, progress.py)
on stderr and through the Python logger `hive_aot.progress`. Here that logger is forwarded into Dagster's own
(`get_dagster_logger`), which Dagster captures into the log of the step that is running, beside its events: the
run's page shows each step's phases and their times, whatever the instance's `python_logs` settings say. Outside a
step nothing captures that logger, and nothing is printed.
"""

from __future__ import annotations

import logging

import dagster as dg

from ..core.progress import LOG


class _IntoRunLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        dg.get_dagster_logger("hive_aot").log(record.levelno, record.getMessage())


def forward_step_lines() -> None:
    """Forward the step lines into the running Dagster step's log (once per process, however often called)."""
    if not any(isinstance(h, _IntoRunLog) for h in LOG.handlers):
        LOG.addHandler(_IntoRunLog())
