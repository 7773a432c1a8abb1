"""Named points in a store write, where the fault-loop tests kill a build (tests/store/test_store_faults.py).

Every backend reports, for each object it writes or deletes, `temp:<area>` while the new bytes are not visible
yet (a local temporary, complete, before its rename; an S3 request about to go out: S3 makes each object
visible whole or not at all, and a single PUT's progress callbacks proved to come after the object was
there), `done:<area>` once they are,
and `delete:<area>` after a delete; `<area>` is the key's first component (blobs, staging, manifests, refs,
signatures, profiles.json). Two variables, unset in production (then this costs one dict lookup per write):

- HIVE_AOT_STORE_EVENTS=<file>: append each event's name to the file, one per line (a calibration run).
- HIVE_AOT_STORE_KILL=<event>[#<n>]: SIGKILL this process's group at the n-th (default first) occurrence of
  the event, as a container kill would: the kill lands at a chosen point of the publish window, not at a
  wall-clock guess.
"""

from __future__ import annotations

import os
import signal
import threading

from ..core import settings

EVENTS_ENV, KILL_ENV = settings.STORE_EVENTS.name, settings.STORE_KILL.name
_seen: dict[str, int] = {}
_lock = threading.Lock()


def area(key: str) -> str:
    return key.lstrip("/").split("/", 1)[0]


def store_event(phase: str, key: str) -> None:
    record, kill = settings.STORE_EVENTS.get(), settings.STORE_KILL.get()
    if not (record or kill):
        return
    event = f"{phase}:{area(key)}"
    with _lock:
        _seen[event] = n = _seen.get(event, 0) + 1
        if record:
            with open(record, "a") as f:
                f.write(f"{event}#{n}\n")
    if kill and kill in (f"{event}#{n}", event if n == 1 else None):
        _kill_self()


def _kill_self() -> None:
    if os.getpgrp() == os.getpid():  # a group of its own (the tests start it so): its children die with it
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
