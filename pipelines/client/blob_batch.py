"""A pull's blobs fetched several at once: the files of a sharded artifact on several cores."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from ..store import Store
from .blob_cache import CachedBlob, TransferStats, fetch_verified

BLOBS_AT_ONCE_MAX = 4  # blobs fetched at once on a host with cores to spare (see blobs_at_once)


def blobs_at_once() -> int:
    """How many blobs a pull fetches at once. A blob's sha256 is one sequential stream on one core (about 1.3 GB/s
    here with SHA extensions), below what a fast link delivers: fetching several files of a sharded artifact at once
    hashes them on several cores. A 2-core host fetches one at a time: its cores are busy with the bytes."""
    return max(1, min(BLOBS_AT_ONCE_MAX, (os.cpu_count() or 1) // 2))


def fetch_blobs(store: Store, sizes: dict[str, int], progress=None, *, stats: TransferStats | None = None,
                at_once: int | None = None) -> dict[str, CachedBlob]:
    """fetch_verified for every digest -> size, `at_once` at a time; the first failure is raised (the rest kept)."""
    stats = stats if stats is not None else TransferStats()
    n = min(at_once or blobs_at_once(), len(sizes))
    if n <= 1:
        return {d: fetch_verified(store, d, size, progress, stats=stats) for d, size in sizes.items()}
    with ThreadPoolExecutor(n, thread_name_prefix="pull-blob") as pool:
        futures = {d: pool.submit(fetch_verified, store, d, size, progress, stats=stats) for d, size in sizes.items()}
        try:
            return {d: f.result() for d, f in futures.items()}
        finally:
            for f in futures.values():
                f.cancel()  # no-op on the finished ones
