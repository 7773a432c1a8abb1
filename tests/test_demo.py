"""`make demo` and `make ui` use this checkout's registry, local store and Dagster instance, whatever the
shell exports: someone who uses hive-aot at work may have HIVE_AOT_STORE pointing at production."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path.cwd()


@pytest.mark.parametrize("target, module", [("demo", "pipelines.demo"), ("ui", "pipelines.orchestration.ui")])
def test_checkout_commands_ignore_the_shells_store_and_instance(target, module):
    env = {**os.environ, "HIVE_AOT_STORE": "s3://production-bucket/artifacts", "DAGSTER_HOME": "/srv/dagster",
           "HIVE_AOT_REGISTRY": "/etc/hive-aot/registry.yaml"}
    dry = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    (line,) = [x for x in dry.splitlines() if f"-m {module}" in x]
    assert line.startswith(f"HIVE_AOT_REGISTRY={REPO}/registry.yaml HIVE_AOT_STORE={REPO}/artifacts "
                           f"DAGSTER_HOME={REPO}/.dagster "), line
    assert "production-bucket" not in dry and "/srv/dagster" not in dry
