"""Where hive-aot keeps local state, and the rules for names that come from untrusted sources."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import SourceError


def cache_root() -> Path:
    """Local cache for snapshots, reference logits and pulled blobs (`$HIVE_AOT_CACHE`)."""
    return Path(os.environ.get("HIVE_AOT_CACHE") or Path.home() / ".cache" / "hive-aot")


def work_root() -> Path:
    """Scratch space for builds, validations and child-process exchanges (`<cache>/work`), created on demand."""
    root = cache_root() / "work"
    root.mkdir(parents=True, exist_ok=True)
    return root


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


def confined(root: Path, rel: str, within: Path | None = None) -> Path:
    """Join and check that the real path stays inside `within` (default root), symlinks included.

    `within` is wider than root only for a Hugging Face cache snapshot, whose files are symlinks
    into the `blobs/` of the same `models--org--name` tree (see sources.hf_cache_repo_dir).
    """
    safe_relpath(rel)
    p = root / rel
    fence = within or root
    real_fence = fence.resolve()
    real = p.resolve()
    if real != real_fence and real_fence not in real.parents:
        raise SourceError(f"refusing {rel!r}: it resolves outside {fence} (symlink?)")
    return p
