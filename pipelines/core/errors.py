"""Exceptions whose message is the one line a user sees, and the exit codes the CLI returns.

Every error the CLI reports is a `HiveError`: its `str()` is a complete, single-line explanation
and `exit_code` is what the process returns. Stdlib only: settings.py builds on it.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What a `hive-aot` process returns (README's CLI table): the one list of them."""

    OK = 0
    ERROR = 1  # any HiveError without a code of its own
    USAGE = 2  # a bad command line or setting
    REJECTED = 3  # built but failed validation: nothing published
    REVIEW = 4  # `check`: supported, but a person must review it first
    INCOMPATIBLE = 5  # `check`: no recipe applies on this hardware
    ENGINE_CRASHED = 6  # a native engine died in its child process
    RESOURCES = 7  # not enough memory or disk (refused up front, or the disk filled)
    INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
    BROKEN_PIPE = 141  # the reader went away (`hive-aot ls | head`), as shells report SIGPIPE


class HiveError(Exception):
    """A user-facing failure: bad input, refused source, store problem."""

    exit_code = ExitCode.ERROR

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

    exit_code = ExitCode.REJECTED


class EngineCrashed(HiveError):
    """A native engine (llama.cpp, ...) died from a signal, or exited without a result, in its child process."""

    exit_code = ExitCode.ENGINE_CRASHED


class EngineFailed(HiveError):
    """A native engine's child process raised an unexpected exception."""


class ResourceError(HiveError):
    """A step needs more memory or disk than this host has (refused before work starts), or the disk filled
    up during a build (partial files removed). `plan`: the memory plan's JSON, when one was made."""

    exit_code = ExitCode.RESOURCES

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
