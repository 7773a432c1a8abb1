"""Exceptions whose message is the one line a user sees.

Every error the CLI reports is a `HiveError`: its `str()` is a complete, single-line explanation
and `exit_code` is what the process returns.
"""

from __future__ import annotations


class HiveError(Exception):
    """A user-facing failure: bad input, refused source, store problem."""

    exit_code = 1

    def __init__(self, message: str):
        # One line, always: multi-line causes are folded so logs and `--json` stay parseable.
        super().__init__(" ".join(str(message).split()))


class ConfigError(HiveError):
    """registry.yaml or a recipe file is invalid."""


class SourceError(HiveError):
    """A model source cannot be fetched or is refused (pickle weights, path traversal, ...)."""


class ModelFormatError(HiveError):
    """config.json, safetensors or tokenizer content is malformed or inconsistent."""


class NotApplicableError(HiveError):
    """A recipe does not apply to the model (architecture, status, review)."""


class StoreError(HiveError):
    """The artifact store is unreachable, not writable, or holds inconsistent data."""


class IntegrityError(StoreError):
    """A blob or file does not match its recorded sha256 or size."""


class ValidationFailed(HiveError):
    """The artifact was built but failed numerical validation: nothing is published."""

    exit_code = 3


class EngineCrashed(HiveError):
    """A native engine (llama.cpp, ...) died from a signal, or exited without a result, in its child process."""

    exit_code = 6


class EngineFailed(HiveError):
    """A native engine's child process raised an unexpected exception."""


class ResourceError(HiveError):
    """A step needs more memory or disk than this host has (refused before work starts), or the disk filled
    up during a build (partial files removed). `plan`: the memory plan's JSON, when one was made."""

    exit_code = 7

    def __init__(self, message: str, plan: dict | None = None):
        super().__init__(message)
        self.plan = plan


class DiskFull(ResourceError):
    """A write failed for lack of space (ENOSPC, EDQUOT, or EFBIG from a file size limit). `path` and
    `errno_code` let a caller that knows the step re-word the message; both are None for an error that
    crossed a process boundary (its message is already complete)."""

    def __init__(self, message: str, path: str | None = None, errno_code: int | None = None):
        super().__init__(message)
        self.path = path
        self.errno_code = errno_code
