"""Where hive-aot keeps local state, and the rules for names that come from untrusted sources."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import settings
from .errors import SourceError


def cache_root() -> Path:
    """Local cache for snapshots, reference logits and pulled blobs (`$HIVE_AOT_CACHE`)."""
    return Path(settings.CACHE.get() or Path.home() / ".cache" / "hive-aot")


def work_root() -> Path:
    """Scratch space for builds, validations and child-process exchanges (`<cache>/work`), created on demand."""
    root = cache_root() / "work"
    root.mkdir(parents=True, exist_ok=True)
    return root


LOCK_NAME = ".hive-aot-lock"


@contextmanager
def work_dir(prefix: str) -> Iterator[Path]:
    """A private scratch directory under work_root(), removed on exit. An exclusive lock on a file inside
    is held while it lives: the kernel drops it when the process dies however it dies (kill -9 too), so
    reclaim_work() can tell a dead process's leftovers from a live one's."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=work_root()))
    fd = os.open(path / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def reclaim_work(unlocked_grace_s: float = 3600.0) -> list[str]:
    """Remove the scratch directories of dead processes (their lock is free); never a live one's.

    A directory without a lock file is either microseconds old (created, lock not yet made) or left by an
    older version: it is removed only once older than `unlocked_grace_s`."""
    removed = []
    for entry in sorted(work_root().iterdir()):
        if not entry.is_dir() or entry.is_symlink():
            continue
        if not (entry / LOCK_NAME).exists():
            if time.time() - entry.stat().st_mtime > unlocked_grace_s:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
            continue
        if lock_is_free(entry / LOCK_NAME):  # else its process is alive
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


@contextmanager
def exclusive_lock(lock: Path, mode: int = 0o644) -> Iterator[int]:
    """An exclusive flock on the file `lock` for the block (waiting for its holder); the file is removed on
    release. Removing it is safe because a waiter checks, once it holds the lock, that the path still names
    the inode it locked; otherwise its lock is on a removed file and it starts over. OSErrors (a directory
    that cannot hold the file) reach the caller."""
    while True:
        fd = _open_lock_file(lock, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass  # removed by the holder we waited for
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask (not ours to change when another user made it)
        except OSError:
            pass
        yield fd
    finally:
        try:
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)


_LOCK_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_lock_file(lock: Path, mode: int) -> int:
    """An fd on the regular file `lock`, created if absent. Read-only suffices for flock, so a lock file left by
    a killed process of another user still opens. A shared cache is writable by others: a symlink planted there
    must not make us create or chmod a file elsewhere, and a FIFO must not block the open, so anything but a
    regular file is removed (it was never a lock of ours) and the open starts over; a directory is an error."""
    for _ in range(8):
        try:
            fd = os.open(lock, _LOCK_OPEN | os.O_CREAT, mode)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            os.unlink(lock)  # a symlink: removing it touches only the link
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        if os.path.isdir(lock) and not os.path.islink(lock):
            raise IsADirectoryError(errno.EISDIR, "a directory is where a lock file belongs", str(lock))
        os.unlink(lock)
    raise OSError(errno.EAGAIN, "the lock file keeps being replaced", str(lock))


def try_lock(lock: Path) -> int | None:
    """The fd of an exclusive flock on `lock` taken without waiting, or None when a live process holds it (or
    the file is gone). Release with release_lock."""
    try:
        fd = os.open(lock, _LOCK_OPEN)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, "not a lock file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino == os.stat(lock).st_ino:
            return fd
    except OSError:  # BlockingIOError: held; FileNotFoundError: removed meanwhile
        pass
    os.close(fd)
    return None


def release_lock(lock: Path, fd: int) -> None:
    """Remove `lock` and drop the flock held on it (waiters then find the path gone and start over)."""
    try:
        os.unlink(lock)
    except OSError:
        pass
    os.close(fd)


def lock_is_free(path: Path) -> bool:
    """Whether no live process holds an flock on `path` (the kernel releases a dead process's locks)."""
    try:
        fd = os.open(path, _LOCK_OPEN)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# One grammar for model ids, checked wherever an id enters (registry, CLI, sources, pull) and wherever
# one becomes a path: the Hugging Face repo id rules. `org/name`, each part 1-96 letters, digits, '.',
# '_' or '-', starting with a letter or digit and not ending in '.' or '-', never '--' or '..'.
# Without '--' the slug `org--name` is injective (`team--x/model` cannot collide with `team/x--model`),
# and 96 + 2 + 96 characters fit in any file name.
MODEL_ID_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
MODEL_ID_PATTERN = rf"(?!\S*--)(?!\S*\.\.){MODEL_ID_PART}/{MODEL_ID_PART}"
_MODEL_ID_RE = re.compile(MODEL_ID_PATTERN)


def check_model_id(model_id: str, *, hint: str = "") -> str:
    """`model_id` if it follows the grammar above, else a one-line SourceError."""
    if isinstance(model_id, str) and _MODEL_ID_RE.fullmatch(model_id):
        return model_id
    shown = repr(model_id if not isinstance(model_id, str) or len(model_id) <= 100 else model_id[:97] + "...")
    raise SourceError(f"{shown} is not a model id: org/name, each part 1-96 letters, digits, '.', '_' or '-' "
                      f"(starting with a letter or digit, no '--' or '..'){hint}")


def model_slug(model_id: str) -> str:
    """`org/name` -> `org--name`, the form used in store paths (injective for valid ids)."""
    return check_model_id(model_id).replace("/", "--")


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


def resolved(path: Path, shown: str | None = None) -> Path:
    """path.resolve(), with a symlink loop (which pathlib raises as RuntimeError) a one-line SourceError."""
    try:
        return path.resolve()
    except RuntimeError:
        raise SourceError(f"refusing {shown or str(path)!r}: a symlink loop (links that lead back to themselves)") from None


def confined(root: Path, rel: str, within: Path | None = None) -> Path:
    """Join and check that the real path stays inside `within` (default root), symlinks included.

    `within` is wider than root only for a Hugging Face cache snapshot, whose files are symlinks
    into the `blobs/` of the same `models--org--name` tree (see sources.hf_cache_repo_dir).
    """
    safe_relpath(rel)
    p = root / rel
    fence = within or root
    real_fence = resolved(fence)
    real = resolved(p, rel)
    if real != real_fence and real_fence not in real.parents:
        raise SourceError(f"refusing {rel!r}: it resolves outside {fence} (symlink?)")
    return p


def publish_cache_entry(tmp: Path, entry: Path, done: str) -> None:
    """Rename a finished scratch directory whole into the cache as `entry` (the work root is inside the cache
    root: one file system), so readers never see a partial entry; `done` is the file written last. A concurrent
    builder's finished entry stands (same key, same content); an entry without `done` is damaged (a file lost
    from the cache) and is replaced, rather than failing every later build."""
    try:
        os.rename(tmp, entry)
    except OSError:
        if (entry / done).is_file():
            return
        shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)


def link_or_copy(src: Path, dest: Path) -> None:
    """A hard link when the source already has the served mode (0644), else a copy: a link shares the
    inode, and setting the mode on it would change the user's source file."""
    if (src.stat().st_mode & 0o777) == 0o644:
        try:
            os.link(src, dest)
            return
        except OSError:
            pass
    shutil.copyfile(src, dest)


def replace_with_json(path: Path, doc) -> None:
    """Write `doc` as JSON to `path` all at once: a fresh, exclusively created temporary beside it (never a fixed
    name a link could be planted at, `.<name>.<random>.tmp`), renamed over; removed again if anything fails."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_small_file(path: Path, limit: int, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Key files, recipes and registries come from
    paths a user (or a template) names: /dev/zero would fill memory, a FIFO would block forever at open, so
    the file is opened without blocking, must be regular, and is read no further than the limit. ValueError
    (one line) for anything else; OSError as the system reports it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"is larger than {limit} bytes")
    return data
