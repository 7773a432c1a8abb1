"""Per-file wall times of the last `make test` (tests/run.py records them in the cache after each run; the
committed tests/durations.json serves a fresh clone). Only the order in which files are handed to the xdist
workers depends on them (tests/conftest.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

COMMITTED = Path(__file__).parent / "durations.json"


def durations_cache() -> Path:
    return Path(os.environ.get("HIVE_AOT_TEST_DURATIONS")
                or Path.home() / ".cache" / "hive-aot" / "test-durations.json")


def known_durations() -> dict[str, float]:
    """{"test_x.py": seconds}: the cache's, else the committed copy's, else none."""
    for path in (durations_cache(), COMMITTED):
        try:
            return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return {}
