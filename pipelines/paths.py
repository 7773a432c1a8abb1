"""Where hive-aot keeps local state, and the rules for names that come from untrusted sources."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import SourceError


def cache_root() -> Path:
    """Local cache for snapshots, reference logits and pulled blobs (`$HIVE_AOT_CACHE`)."""
    return Path(os.environ.get("HIVE_AOT_CACHE") or Path.home() / ".cache" / "hive-aot")


def model_slug(model_id: str) -> str:
    """`org/name` -> `org--name`, the form used in store paths."""
    return model_id.replace("/", "--")


_BAD_CHARS = re.compile(r"[\x00-\x1f\\:]")


def safe_relpath(name: str, *, what: str = "file name") -> str:
    """Return `name` if it is a plain relative POSIX path confined to its root, else raise.

    Applied to every file name a source or manifest hands us before it touches the file system.
    """
    if not name or _BAD_CHARS.search(name) or name.startswith("/"):
        raise SourceError(f"refusing {what} {name!r}: not a plain relative path")
    # Split the raw string: PurePosixPath would normalise "a/./b" and "a//b" away before we look.
    parts = name.split("/")
    if any(p in ("..", ".", "") for p in parts):
        raise SourceError(f"refusing {what} {name!r}: path escapes its directory")
    return name


def confined(root: Path, rel: str) -> Path:
    """Join and check that the real path stays inside root (symlinks included)."""
    safe_relpath(rel)
    p = root / rel
    real_root = root.resolve()
    real = p.resolve()
    if real != real_root and real_root not in real.parents:
        raise SourceError(f"refusing {rel!r}: it resolves outside {root} (symlink?)")
    return p
