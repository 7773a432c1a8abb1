"""The real Dagster UI: `make ui`'s launcher (pipelines.orchestration.ui, which execs `dg dev -w
workspace.yaml`) serves the code location headless, and its GraphQL API lists our assets and checks and
accepts a new model partition. A busy port is refused before anything starts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from factories import SMOLLM2_PRE
from processes import free_port, stop_group

REPO = Path.cwd()


def _graphql(port: int, query: str, variables: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", method="POST",
                                 data=json.dumps({"query": query, "variables": variables or {}}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        doc = json.loads(r.read())
    assert "errors" not in doc, doc["errors"]
    return doc["data"]


@contextlib.contextmanager
def running_ui(tmp_path: Path, registry: Path):
    """`make ui`'s launcher on a free port with its own DAGSTER_HOME (the committed instance settings) and
    store; yields the port once the code location has loaded."""
    port = free_port()
    home = tmp_path / "dagster-home"
    home.mkdir()
    shutil.copyfile(REPO / "pipelines" / "orchestration" / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "DAGSTER_HOME": str(home), "HIVE_AOT_REGISTRY": str(registry),
           "HIVE_AOT_STORE": str(tmp_path / "store"), "HIVE_AOT_CACHE": str(tmp_path / "cache")}
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
        stop_group(proc)
        log.close()


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory, smollm2_small_vocab_dir) -> tuple[int, Path]:
    """One `dg dev` for the module (a start costs half a minute of CPU): the packaged registry and recipes plus
    an f32 GGUF recipe and the onboarding test's model (a 2-layer Llama on SmolLM2's BPE cut to 2,048 tokens:
    the UI shows the same pages, the build costs seconds less). Yields (port, its directory)."""
    from factories import make_llama

    root = tmp_path_factory.mktemp("ui")
    # hidden 256: the f32 GGUF is over a MiB, as the partition page's size column is checked in MiB
    model = make_llama(root / "tiny-llama", smollm2_small_vocab_dir, hidden_size=256, intermediate_size=512)
    with running_ui(root, _ui_registry(root, model)) as port:
        yield port, root


def _repository(port: int) -> tuple[str, str]:
    repo = _graphql(port, "{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }")
    node = repo["repositoriesOrError"]["nodes"][0]
    return node["location"]["name"], node["name"]


def test_ui_serves_assets_checks_and_partitions(dagster_ui):
    port, _ = dagster_ui
    data = _graphql(port, "{ assetNodes { assetKey { path } hasAssetChecks partitionDefinition { type } } }")
    nodes = {"/".join(n["assetKey"]["path"]): n for n in data["assetNodes"]}
    assert {"snapshot", "compatibility", "artifact/gguf-f16", "published/gguf-q4_k_m"} <= set(nodes)
    assert nodes["artifact/gguf-f16"]["hasAssetChecks"] is True
    assert nodes["snapshot"]["partitionDefinition"]["type"] == "DYNAMIC"
    assert _add_partition(port, "test/ui-partition") == "test/ui-partition"


def _add_partition(port: int, key: str) -> str:
    loc, repo = _repository(port)
    added = _graphql(port, """mutation($loc: String!, $repo: String!, $key: String!) {
        addDynamicPartition(repositorySelector: {repositoryLocationName: $loc, repositoryName: $repo},
                            partitionsDefName: "models", partitionKey: $key) {
          __typename ... on AddDynamicPartitionSuccess { partitionKey } } }""", {"loc": loc, "repo": repo, "key": key})
    return added["addDynamicPartition"].get("partitionKey")


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


MODEL = "test/ui-model"
SCREENSHOTS = REPO / "tests" / "screenshots"  # kept after the run (docs/ui-*.png in the README are copies)


def _ui_registry(tmp_path: Path, model: Path) -> Path:
    recipes = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes", recipes)
    (recipes / "gguf-f32.yaml").write_text(yaml.safe_dump({
        "id": "gguf-f32", "kind": "gguf", "options": {"outtype": "f32", "bpe_pre_fallback": SMOLLM2_PRE},
        "runtime_profiles": ["llm-llamacpp-cpu"],
        "description": "f32 GGUF (lossless: tiny random models have small logit margins)",
        "validation": {"min_top1_agreement": 0.99, "max_mean_kl": 0.001}}))
    reg = yaml.safe_load((REPO / "registry.yaml").read_text())
    reg.update(recipes_dir=str(recipes), models=[{"id": MODEL, "source": str(model), "recipes": ["gguf-f32"]}])
    path = tmp_path / "registry.yaml"
    path.write_text(yaml.safe_dump(reg))
    return path


def test_onboard_from_the_ui_then_read_it_in_a_browser(dagster_ui):
    """GraphQL as the UI drives it (add the partition, launch the model's assets, wait, read the check and the
    staleness), then headless Chromium on the asset lineage, the artifact's partition page and its check,
    asserting on what a person sees there; screenshots are saved."""
    from webdriver import Browser, browser_missing

    port, root = dagster_ui
    assert _add_partition(port, MODEL) == MODEL
    loc, repo = _repository(port)
    keys = [["snapshot"], ["compatibility"], ["artifact", "gguf-f32"], ["published", "gguf-f32"]]
    launched = _graphql(port, """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
        __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }""", {"p": {
        "selector": {"repositoryLocationName": loc, "repositoryName": repo, "jobName": "onboard",
                     "assetSelection": [{"path": k} for k in keys]},
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": MODEL}]}}})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    deadline = time.time() + 600
    while True:
        status = _graphql(port, "query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }",
                          {"id": run_id})["runOrError"]["status"]
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        assert time.time() < deadline, f"run {run_id} still {status}"
        time.sleep(2)
    assert status == "SUCCESS", (root / "dg-dev.log").read_text()[-3000:]

    (check,) = _graphql(port, """query($p: String) { assetCheckExecutions(assetKey: {path: ["artifact", "gguf-f32"]},
        checkName: "numerical_parity", partition: $p, limit: 1) { status partition runId
        evaluation { success description } } }""", {"p": MODEL})["assetCheckExecutions"]
    assert check["status"] == "SUCCEEDED" and check["evaluation"]["success"] and check["runId"] == run_id
    stale = _graphql(port, """query($p: String) { assetNodes(assetKeys: [{path: ["published", "gguf-f32"]},
        {path: ["artifact", "gguf-f16"]}]) { assetKey { path } staleStatus(partition: $p) } }""", {"p": MODEL})
    status_of = {"/".join(n["assetKey"]["path"]): n["staleStatus"] for n in stale["assetNodes"]}
    assert status_of == {"published/gguf-f32": "FRESH", "artifact/gguf-f16": "MISSING"}
    meta = _graphql(port, """query($p: String!) { assetNodes(assetKeys: [{path: ["artifact", "gguf-f32"]}]) {
        assetMaterializations(partitions: [$p], limit: 1) { metadataEntries { label
        ... on TextMetadataEntry { text } } } } }""", {"p": MODEL})
    entries = {e["label"]: e.get("text") for e in meta["assetNodes"][0]["assetMaterializations"][0]["metadataEntries"]}
    build_id = entries["build_id"]
    assert len(build_id) == 64

    why = browser_missing()
    if why:  # `make setup` installs Chromium: its absence is a failure unless skipping was asked for
        if os.environ.get("HIVE_AOT_SKIP_BROWSER"):
            pytest.skip(f"browser part (HIVE_AOT_SKIP_BROWSER): {why}")
        pytest.fail(f"the browser part cannot run: {why}; set HIVE_AOT_SKIP_BROWSER=1 to skip it knowingly")
    SCREENSHOTS.mkdir(exist_ok=True)
    base = f"http://127.0.0.1:{port}"
    browser = Browser()
    try:
        browser.open(f"{base}/assets/artifact/gguf-f32?view=lineage")
        # a fresh profile gets Dagster's "Join the Dagster community" dialog over the page: dismiss it
        browser.wait_for_text("Join the Dagster community", timeout=60)
        assert browser.click_text("Skip")
        # the artifact between its sources and its publish step (group "publish"), its check passed
        text = browser.wait_for_text("snapshot", "compatibility", "sources", "publish", "gguf-f32", "2 / 2 Passed")
        assert "Join the Dagster community" not in text
        browser.screenshot(SCREENSHOTS / "ui-lineage.png")

        browser.open(f"{base}/assets/artifact/gguf-f32?view=partitions&partition={MODEL.replace('/', '%2F')}")
        text = browser.wait_for_text(MODEL, "Materialized", "build_id", build_id, "size", "MiB", "store_uri")
        browser.screenshot(SCREENSHOTS / "ui-partition.png")

        browser.open(f"{base}/assets/artifact/gguf-f32?view=checks")
        # two blocking checks, both passed; the integrity one says what it verified
        browser.wait_for_text("Checks (2)", "integrity", "numerical_parity", "every blob intact")
        assert browser.click_text("numerical_parity")
        text = browser.wait_for_text("numerical_parity", "This is a blocking asset check", "Passed", MODEL,
                                     "top1_agreement", "mean_kl", "max_abs_logit_delta", "parity")
        # the parity table: one row per prompt, the columns the check writes
        assert "prompt\ttop1_agreement\tmean_kl\tmax_abs_logit_delta" in text
        browser.screenshot(SCREENSHOTS / "ui-check.png")
    finally:
        browser.close()
    for name in ("ui-lineage.png", "ui-partition.png", "ui-check.png"):
        assert (SCREENSHOTS / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
