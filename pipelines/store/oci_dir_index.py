"""index.json of an OCI image layout (oci_dir.py): the tags it names, and the file read once per version.

A tag is the `org.opencontainers.image.ref.name` annotation of its descriptor. image-spec's grammar of a ref.name
(annotations.md: components of alphanumerics joined by one of `-._:@+` or `--`), which skopeo's `oci:` transport
enforces, is stricter than a tag's: hive-aot's own `_m.<recipe>.<build>` cannot start with '_', and a tag such
as `v1-` or `a__b` breaks it too. So ref_name spells those differently, reversibly (tag_of), in forms no tag can
take (no tag holds '+' or '@').
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from ..core.errors import IntegrityError, StoreError
from .oci_client import INDEX_TYPE

REF_NAME = "org.opencontainers.image.ref.name"
INDEX_LIMIT = 256 << 20  # the pool's index lists every blob (~250 bytes each)
_COMPONENT = r"[A-Za-z0-9]+(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*"
_REF_NAME = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
OWN, ENCODED = "hive-aot+", "hive-aot@"


def ref_name(tag: str) -> str:
    """The ref.name of a tag: itself where the grammar allows it; hive-aot's own tags (`_m.`, refused for their
    leading '_') as `hive-aot+m.`; any other (`v1-`, `a__b`) as `hive-aot@<hex of the tag>`."""
    name = OWN + tag[1:] if tag.startswith("_") else tag
    return name if _REF_NAME.fullmatch(name) else ENCODED + tag.encode().hex()


def tag_of(name: str) -> str:
    """ref_name backwards (a name it never makes, another tool's, comes back as it is)."""
    if name.startswith(ENCODED):
        try:
            return bytes.fromhex(name[len(ENCODED):]).decode()
        except ValueError:
            return name
    return "_" + name[len(OWN):] if name.startswith(OWN) else name


def ref_of(entry: dict[str, Any]) -> str | None:
    """The ref.name of an index.json descriptor, None when it has none (a manifest kept untagged)."""
    name = (entry.get("annotations") or {}).get(REF_NAME)
    return name if isinstance(name, str) else None


def index_bytes(entries: list[dict[str, Any]]) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": entries},
                      indent=1, sort_keys=True).encode() + b"\n"


class IndexCache:
    """index.json's descriptors per repository, parsed once per version of the file: it is only ever replaced by
    rename, so its (inode, mtime, size) tells a new one."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[tuple[int, int, int], list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def entries(self, repo: str, path: Path, where: str) -> list[dict[str, Any]]:
        """The descriptors of `path` ([] when there is none); one line for a file that is no OCI index."""
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                with self._lock:
                    cached = self._parsed.get(repo)
                if cached is not None and cached[0] == stamp:
                    return cached[1]
                raw = f.read(INDEX_LIMIT + 1)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StoreError(f"{where}: cannot read {path.name} ({e.strerror or type(e).__name__})") from None
        try:
            entries = json.loads(raw).get("manifests")
            if len(raw) > INDEX_LIMIT or not isinstance(entries, list) or not all(
                    isinstance(e, dict) and isinstance(e.get("digest"), str) for e in entries):
                raise ValueError
        except (ValueError, AttributeError, RecursionError):
            raise IntegrityError(f"{where}/{path.name} is not an OCI image index: the layout is damaged") from None
        with self._lock:
            self._parsed[repo] = (stamp, entries)
        return entries


__all__ = ["REF_NAME", "IndexCache", "index_bytes", "ref_name", "ref_of", "tag_of"]
