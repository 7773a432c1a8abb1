"""The real Dagster UI: `make ui`'s launcher (pipelines.orchestration.ui, which execs `dg dev -w
workspace.yaml`) serves the code location headless, and its GraphQL API lists our assets and checks and
accepts a new model partition. A busy port is refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path.cwd()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graphql(port: int, query: str, variables: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", method="POST",
                                 data=json.dumps({"query": query, "variables": variables or {}}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        doc = json.loads(r.read())
    assert "errors" not in doc, doc["errors"]
    return doc["data"]


@pytest.fixture
def dagster_ui(tmp_path):
    port = _free_port()
    home = tmp_path / "dagster-home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home), "HIVE_AOT_REGISTRY": str(REPO / "registry.yaml"),
           "HIVE_AOT_STORE": str(tmp_path / "store")}
    log = open(tmp_path / "dg-dev.log", "w")
    # Own session + default signal handling: a backgrounded `dg dev` otherwise ignores SIGINT/SIGTERM.
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.orchestration.ui", "--port", str(port)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL),
                                                signal.signal(signal.SIGTERM, signal.SIG_DFL)))
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail("dg dev did not start: " + (tmp_path / "dg-dev.log").read_text()[-3000:])
                time.sleep(1)
        # the code location loads after the webserver answers
        for _ in range(120):
            data = _graphql(port, "{ assetNodes { assetKey { path } } }")
            if data["assetNodes"]:
                break
            time.sleep(1)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_ui_serves_assets_checks_and_partitions(dagster_ui):
    port = dagster_ui
    data = _graphql(port, "{ assetNodes { assetKey { path } hasAssetChecks partitionDefinition { type } } }")
    nodes = {"/".join(n["assetKey"]["path"]): n for n in data["assetNodes"]}
    assert {"snapshot", "compatibility", "artifact/gguf-f16", "published/gguf-q4_k_m"} <= set(nodes)
    assert nodes["artifact/gguf-f16"]["hasAssetChecks"] is True
    assert nodes["snapshot"]["partitionDefinition"]["type"] == "DYNAMIC"
    repo = _graphql(port, "{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }")
    loc = repo["repositoriesOrError"]["nodes"][0]
    added = _graphql(port, """mutation($loc: String!, $repo: String!) {
        addDynamicPartition(repositorySelector: {repositoryLocationName: $loc, repositoryName: $repo},
                            partitionsDefName: "models", partitionKey: "test/ui-model") {
          __typename ... on AddDynamicPartitionSuccess { partitionKey } } }""",
                     {"loc": loc["location"]["name"], "repo": loc["name"]})
    assert added["addDynamicPartition"]["partitionKey"] == "test/ui-model"


def test_busy_port_is_refused_in_one_line_and_a_free_one_is_chosen():
    from pipelines.orchestration.ui import choose_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "pipelines.orchestration.ui", "--port", str(port)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines() == [
            f"hive-aot ui: port {port} on 127.0.0.1 is already in use; pick another with `make ui UI_PORT=N`, "
            "or leave UI_PORT empty for the first free one"]
    # without --port: the first free port from 3000 up, skipping a busy one
    first = choose_port("127.0.0.1", None)
    assert 3000 <= first <= 3099
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        second = choose_port("127.0.0.1", None)
    assert second > first
