"""The parts of one blob download into the cache's partial (blob_cache.py): ranged reads written in place,
several at once, the part list replaced whenever parts complete, and the sha256 following the bytes written.

The sha256 follows the bytes written from the start (the frontier: every part before it complete, the part it is
in written up to there) while later bytes are still coming (hashlib releases the GIL), so it ends a moment after
the last byte. Hashing whole parts as they completed left most of a 1 GiB blob's hash for after the download (0.7
of 1.8 s; bench/s3_read_paths.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import IntegrityError
from ..core.paths import replace_with_json

if TYPE_CHECKING:
    from hashlib import _Hash

    from ..store import Store

HASH_POLL_S = 0.02  # how often the sha256 catches up with the bytes written while parts are in flight


class PartDownload:
    """The parts of blob `digest` (`key` in `store`) fetched into its partial, open at `fd` at the blob's size,
    with the sha256 of the bytes written from the start (into `hasher`, read back `hash_read` bytes at a time).
    `counted(n)`: after each chunk written (stats, progress)."""

    def __init__(self, store: Store, key: str, digest: str, size: int, fd: int, parts: list[tuple[int, int]],
                 part_bytes: int, done: set[int], counted: Callable[[int], None], *, hasher: _Hash,
                 hash_read: int) -> None:
        self.store, self.key, self.digest, self.size, self.fd = store, key, digest, size, fd
        self.parts, self.part_bytes, self.counted = parts, part_bytes, counted
        self.filled = [length if i in done else 0 for i, (_start, length) in enumerate(parts)]  # bytes written per part
        self.hasher, self.at_byte = hasher, 0  # bytes [0, at_byte) are in the digest
        self.view = memoryview(bytearray(hash_read))  # read back into one buffer: no new bytes object per read

    def fetch_part(self, index: int) -> int:
        """Part `index` from the store, written in place (a worker thread); its index."""
        start, length = self.parts[index]
        at = start
        for chunk in self.store.iter_range(self.key, start, length):
            os.pwrite(self.fd, chunk, at)
            at += len(chunk)
            self.filled[index] = at - start  # after the write: the hash may read up to here
            self.counted(len(chunk))
        if at - start != length:  # the stored object is shorter than its manifest says: damaged, not flaky
            raise IntegrityError(f"blob {self.digest[:12]} from {self.store.uri} does not match its manifest sha256 "
                                 f"(it ends after {at} of {self.size} bytes)")
        return index

    def hash_ready(self, budget: int | None = None) -> bool:
        """Hash what is written contiguously past the digest, at most `budget` bytes: then back to the part
        loop, which records finished parts. A hash that followed a faster download to its end kept the part
        list at its first parts meanwhile, so a kill then threw away everything written since. True when it
        stopped at the budget (more is ready to hash)."""
        stop = self.size if budget is None else min(self.size, self.at_byte + budget)
        while self.at_byte < stop:
            index = min(self.at_byte // self.part_bytes, len(self.parts) - 1)
            frontier = min(self.parts[index][0] + self.filled[index], stop)
            if frontier <= self.at_byte:
                return False
            while self.at_byte < frontier:
                n = os.preadv(self.fd, [self.view[:min(len(self.view), frontier - self.at_byte)]], self.at_byte)
                if n <= 0:  # the partial was cut short under us: the digest will not match
                    return False
                self.hasher.update(self.view[:n])
                self.at_byte += n
        return self.at_byte < self.size

    def fetch_missing(self, done: set[int], workers: int, state_file: Path, state: dict) -> None:
        """The parts not in `done`, `workers` at once, each recorded in `done` and the part list as it completes,
        the hash following; then the hash to the end."""
        todo = [i for i in range(len(self.parts)) if i not in done]
        with ThreadPoolExecutor(max(1, min(workers, len(todo) or 1)), thread_name_prefix="pull-part") as pool:
            pending = {pool.submit(self.fetch_part, i) for i in todo}
            try:
                backlog = False  # bytes ready to hash: then the loop only looks for finished parts, never waits
                while pending:
                    finished, pending = wait(pending, timeout=0 if backlog else HASH_POLL_S,
                                             return_when=FIRST_COMPLETED)
                    failed = [f.exception() for f in finished if f.exception() is not None]
                    done.update(f.result() for f in finished if f.exception() is None)
                    # the pages written are the kernel's now: a killed pull resumes after these parts
                    if finished:
                        replace_with_json(state_file, {**state, "done": sorted(done)})
                    if failed:
                        raise failed[0]
                    backlog = self.hash_ready(self.part_bytes)
            finally:
                for f in pending:
                    f.cancel()
        self.hash_ready()

    def hashed(self) -> bool:
        """Whether the sha256 covered the whole blob and matches its digest."""
        return self.at_byte == self.size and self.hasher.hexdigest() == self.digest


__all__ = ["PartDownload"]
