"""Functions tests run in child processes through pipelines.process.isolation (importable via PYTHONPATH)."""

from __future__ import annotations

import builtins
import os

from pipelines.core import errors

IMPORTED_BY = os.getpid()  # which process imported this module: a warm server learns it from the first job


def raise_exception(kind: str, message: str) -> None:
    """Raise `kind`: a HiveError subclass by name, else a builtin exception."""
    raise (getattr(errors, kind, None) or getattr(builtins, kind))(message)


def fill_the_disk(path: str) -> None:
    """A write that fails for lack of space, as the kernel reports it."""
    import errno
    import os

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def load_gguf_verbosely(path: str, repack: bool) -> bool:
    """Load a GGUF with llama.cpp's load log on stderr, with or without the repacked weight copy."""
    from llama_cpp import Llama

    from pipelines.targets.gguf.validate import _without_repacking

    if not repack:
        _without_repacking()
    Llama(model_path=path, n_ctx=64, verbose=True).close()
    return True


def who_imported() -> dict[str, int]:
    """The pid that imported this module, this process's and its parent's."""
    return {"imported_by": IMPORTED_BY, "pid": os.getpid(), "parent": os.getppid()}
