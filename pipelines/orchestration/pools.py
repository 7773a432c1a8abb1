"""Dagster pools and their limits on this project's instances.

Pools bound how many steps of a kind run at once across all runs of an instance (op-level concurrency):
- `validate_large`: every step that runs the reference or an engine (each recipe's parity check). Limit 1:
  onboarding a large model never runs two of them at once, so the memory plan's per-step estimate is the host's
  peak, not a sum.
- `build_<kind>`, `ai100_compile` (hosts with the Cloud AI SDK): the default of the committed dagster.yaml
  (2 per instance); an operator sets one with `dagster instance concurrency set <pool> <n>` or in the UI.

Per-pool limits live in the instance's storage, not in dagster.yaml (which has only a default for every pool),
so `hive-aot onboard` and `make ui` apply them when an instance has none for a pool; a limit an operator set
is left as it is.
"""

from __future__ import annotations

import os
import socket

import dagster as dg

LARGE_MEMORY_POOL = "validate_large"
POOL_LIMITS = {LARGE_MEMORY_POOL: 1}


def apply_pool_limits(instance: dg.DagsterInstance) -> dict[str, int]:
    """Set POOL_LIMITS on the instance where it has no limit of its own for a pool; returns the limits in force."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return {}
    configured = {pool.name: pool.limit for pool in storage.get_pool_limits() if not pool.from_default}
    for pool, limit in POOL_LIMITS.items():
        if pool not in configured:
            storage.set_concurrency_slots(pool, limit)
            configured[pool] = limit
    return {pool: configured[pool] for pool in POOL_LIMITS}


# Tags on the runs `hive-aot onboard` executes in its own process: a run whose process died (kill -9, OOM)
# stays STARTED and keeps its pool slot, which would block every later validation with a limit of 1.
HOST_TAG, PID_TAG = "hive-aot/host", "hive-aot/pid"


def process_tags() -> dict[str, str]:
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def release_dead_claims(instance: dg.DagsterInstance) -> list[str]:
    """Free the slots of our pools held by runs that cannot release them: finished (or deleted) runs, and
    runs of `hive-aot onboard` on this host whose process is gone. Returns their run ids."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return []
    freed = []
    # every pool with a claim: the validate_large limit, and the dagster.yaml default on all the others
    for pool in sorted(set(POOL_LIMITS) | set(storage.get_concurrency_keys())):
        info = storage.get_concurrency_info(pool)
        for run_id in sorted(info.active_run_ids | {s.run_id for s in info.pending_steps}):
            run = instance.get_run_by_id(run_id)
            dead = run is None or run.is_finished
            if not dead and run.tags.get(HOST_TAG) == socket.gethostname() and run.tags.get(PID_TAG, "").isdigit():
                dead = not _process_alive(int(run.tags[PID_TAG]))
            if dead and run_id not in freed:
                storage.free_concurrency_slots_for_run(run_id)
                freed.append(run_id)
    return freed
