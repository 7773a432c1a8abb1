"""Progress bars on stderr (never stdout, which `--json` reserves); silent when stderr is not a TTY."""

from __future__ import annotations

import sys

from tqdm import tqdm
from . import settings


def bar(total: int | None = None, desc: str = "", unit: str = "B") -> tqdm:
    disable = None if not settings.PROGRESS.is_set() else False  # None = auto (TTY only)
    scale = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
                file=sys.stderr, disable=disable, leave=False, dynamic_ncols=True)
