"""What a pull reports: the build it chose, where its files are, and how a server starts on them.

A typed result rather than a dictionary read by string keys, so that a reader's typo is an AttributeError where it
is written, not a None at the far end of a `get`. `to_json()` is the `pull --json` and `serve --dry-run --json`
document, whose keys are a contract of their own (docs/pulling.md): "fetched" shows only for a dry run (false), and
"transfer" only when bytes moved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class AutoTarget:
    """How `--target auto` chose: what was detected on this host, and the runtime profile it led to."""

    detected: str
    devices: int
    evidence: list[str]
    found: str
    profile: str
    why: str


@dataclass(frozen=True)
class Transfer:
    """What reaching DIR cost: bytes downloaded, bytes a killed pull had already written, blobs the cache held."""

    fetched_bytes: int
    resumed_bytes: int
    cached_blobs: int


@dataclass(frozen=True)
class PullResult:
    model_id: str
    build_id: str
    recipe: str
    runtime_profile: str
    dest: str
    files: list[str]
    size: int
    serve: str | None  # the serve command as one shell line, the model directory filled in
    serve_argv: list[str] | None
    env: dict[str, str]
    serve_refused: str | None  # why `hive-aot serve` would not run it (None: it would)
    serve_refused_remote_code: bool  # refused only for trust_remote_code, which a signed build may be allowed
    image: str | None
    already_present: bool
    engines: list[dict[str, Any]] = field(default_factory=list)  # engine versions: validated with vs here
    warnings: list[str] = field(default_factory=list)
    signed_by: str | None = None  # the trusted key that verified the manifest
    auto_target: AutoTarget | None = None
    fetched: bool = True  # False: a dry run, which chose and checked but wrote nothing
    transfer: Transfer | None = None

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        if self.fetched:
            del doc["fetched"]
        if self.transfer is None:
            del doc["transfer"]
        return doc


__all__ = ["AutoTarget", "PullResult", "Transfer"]
