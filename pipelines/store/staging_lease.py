"""A build's hold on its staged candidate while it validates, so that `gc` keeps the candidate's blobs.

A staged build's blobs are referenced only by its staging record until the manifest is written. Validation
can take longer than any age a `gc` run is given (`--min-age`), so age alone cannot tell a dead build's record
from a live one's: the builder re-writes its record every LEASE_REFRESH_S while it validates, and gc treats a
record written within LEASE_S as live whatever its `--min-age`. A dead builder's record stops being refreshed
and is collected once older than both. Publish still checks, after writing the manifest and before the refs
(the commit point), that every blob it names is in the store: a candidate whose blobs a gc took anyway (a
record older than the lease, a validation on another host that never refreshed it) fails in one line and
publishes nothing, instead of a manifest naming a blob that is gone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

LEASE_S = 15 * 60.0  # a staging record written within this is a live build's, for every gc
LEASE_REFRESH_S = 60.0  # how often a validating builder re-writes it (well inside the lease)


@contextmanager
def held(store, key: str, *, refresh_s: float = LEASE_REFRESH_S) -> Iterator[None]:
    """Re-write `key` (its current bytes, unchanged) every `refresh_s` for the block. The block's own writes of
    the record come after it (the thread is stopped first), so a refresh never puts back an older state."""
    raw = store.read_bytes(key)
    if raw is None:
        yield
        return
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(refresh_s):
            try:
                store.write_bytes(key, raw)
            except Exception:  # noqa: BLE001 - a refresh that fails shortens the lease; the publish check still holds
                pass

    t = threading.Thread(target=refresh, name="staging-lease", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def live(age_s: float, min_age_s: float) -> bool:
    """Whether gc must treat a staging record last written `age_s` ago as a live build's."""
    return age_s <= max(min_age_s, LEASE_S)


__all__ = ["LEASE_REFRESH_S", "LEASE_S", "held", "live"]
