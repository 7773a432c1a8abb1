"""How every `hive-aot` command reports: exit codes, one JSON document with `--json`, sizes in one unit system,
tables with a header row, and help that shows every option's default."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

QUIET_HELP = "no progress bars and no step lines on stderr, only errors (sets $HIVE_AOT_QUIET for what it runs)"


def emit(args: argparse.Namespace, doc: Any, human: str) -> None:
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    else:
        print(human)


def size(n: int) -> str:
    """One unit system for every size the CLI prints (binary: KiB, MiB, GiB), as plan and the UI print them."""
    from ..core.units import human_bytes

    return human_bytes(n)


def table(header: Sequence[str], rows: Iterable[Sequence[str]], right: Iterable[int] = ()) -> str:
    """A table whose first row names its columns, each column as wide as its widest value (the last one is not
    padded: a long meaning or path runs on instead of widening every row); columns in `right` align right (sizes)."""
    body = [[str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in [list(header), *body]) for i in range(len(header))]
    aligned = set(right)
    lines = []
    for row in [list(header), *body]:
        cells = [v.rjust(w) if i in aligned else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def has_default(action: argparse.Action) -> bool:
    """Whether an option's default is worth showing: None and False mean "not given" (a flag that is off)."""
    return action.default is not None and action.default is not False and action.default is not argparse.SUPPRESS


class HelpFormatter(argparse.HelpFormatter):
    """Every `hive-aot` parser's: an option with a default says it (`(default: latest)`), unless its text already
    shows it with %(default)s; choices are in the metavar, as argparse prints them."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if has_default(action) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text

    def _split_lines(self, text: str, width: int) -> list[str]:
        # argparse's own, but a line never breaks inside a hyphenated name (a profile id, oci-layout://)
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)
