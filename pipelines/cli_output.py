"""How every `hive-aot` command reports: exit codes, one JSON document with `--json`, sizes in one unit system."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REJECTED, EXIT_REVIEW, EXIT_INCOMPATIBLE = 0, 1, 2, 3, 4, 5
EXIT_RESOURCES = 7  # = errors.ResourceError.exit_code


def emit(args: argparse.Namespace, doc: Any, human: str) -> None:
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    else:
        print(human)


def size(n: int) -> str:
    """One unit system for every size the CLI prints (binary: KiB, MiB, GiB), as plan and the UI print them."""
    from .units import human_bytes

    return human_bytes(n)
