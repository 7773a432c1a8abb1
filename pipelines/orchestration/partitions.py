"""One dynamic partition per model; the key is the HF repo id (`org/name`)."""

from __future__ import annotations

import re

import dagster as dg

models_partitions = dg.DynamicPartitionsDefinition(name="models")

# Characters Dagster's multi-partition keys cannot carry; repo ids never contain them, but a
# hand-written registry might, so refuse loudly instead of letting a key vanish silently.
_FORBIDDEN = re.compile(r"[|,\[\]]")


def partition_key(model_id: str) -> str:
    if _FORBIDDEN.search(model_id):
        raise ValueError(f"model id {model_id!r} contains a character not allowed in a partition key")
    return model_id
