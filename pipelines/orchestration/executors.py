"""Where a run's steps execute. Dagster's default (one process per step on the run's host) unless
HIVE_AOT_CELERY_BROKER names a Celery broker: then every step is a Celery task, picked up by workers on any
host that runs `dagster-celery worker start -A dagster_celery.app` with the same code and environment.

Steps exchange small values only (pinned source, build id, store URI); the weights and artifacts live in the
store, so a step runs wherever a worker is. The values themselves go through the run's IO manager: on one
host the default (files under $DAGSTER_HOME/storage) is enough; across hosts configure dagster-aws's
S3PickleIOManager as `io_manager` (deploy/README.md).
"""

from __future__ import annotations

import dagster as dg

from ..core import settings

# A kind's hardware step (the AI 100 compile) goes to the queue named after its pool (`-q ai100_compile`), served
# by the workers on hosts with that hardware.
CELERY_QUEUE_TAG = "dagster-celery/queue"


def executor_from_env() -> dg.ExecutorDefinition | None:
    """The Celery executor when HIVE_AOT_CELERY_BROKER is set (HIVE_AOT_CELERY_BACKEND defaults to the broker),
    else None: Dagster's default multiprocess executor."""
    broker = settings.CELERY_BROKER.get()
    if not broker:
        return None
    from dagster_celery import celery_executor

    return celery_executor.configured({"broker": broker, "backend": settings.CELERY_BACKEND.get() or broker},
                                      name="celery")
