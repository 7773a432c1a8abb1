"""The real Dagster UI: `make ui` (its launcher pipelines.orchestration.ui runs `dg dev -w workspace.yaml` in a
process group of its own) serves the code location headless, and its GraphQL API lists our assets and checks and
accepts a new model partition; one SIGTERM to `make` stops all of it within seconds. A busy port is refused before
anything starts."""

from __future__ import annotations

import contextlib
import json
import os
import re
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
from processes import free_port

REPO = Path.cwd()


def _graphql(port: int, query: str, variables: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", method="POST",
                                 data=json.dumps({"query": query, "variables": variables or {}}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        doc = json.loads(r.read())
    assert "errors" not in doc, doc["errors"]
    return doc["data"]


def _descendants(root: int) -> list[int]:
    """`root` and every process below it (from /proc: the launcher puts `dg dev` in a process group of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


STOP_WITHIN_S = 10


def _sigterm_stops_everything(make: subprocess.Popen, port: int) -> None:
    """One SIGTERM to `make ui`, as `kill PID` sends it: make, the launcher, `dg dev` and every process of its group
    (webserver, daemon, code servers, run workers) are gone within STOP_WITHIN_S seconds and the port is free again.
    Whatever is left afterwards is killed, and named in the failure."""
    from pipelines.orchestration.ui import port_is_free

    pids = _descendants(make.pid)
    assert len(pids) >= 4, pids  # make, the launcher, dg dev and at least the webserver
    started = time.monotonic()
    make.send_signal(signal.SIGTERM)
    while any(_running(p) for p in pids) and time.monotonic() - started < STOP_WITHIN_S:
        make.poll()  # reap make itself
        time.sleep(0.1)
    took = time.monotonic() - started
    left = [p for p in pids if _running(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {took:.1f} s after SIGTERM: {left}"
    assert make.wait(5) == -signal.SIGTERM  # make stopped its recipe, then itself, by the same signal
    assert port_is_free("127.0.0.1", port)
    print(f"make ui stopped {took:.1f} s after SIGTERM")


@contextlib.contextmanager
def running_ui(tmp_path: Path, registry: Path):
    """`make ui` on a free port with its own DAGSTER_HOME (the committed instance settings), registry and store;
    yields the port once the code location has loaded. Stopped by one SIGTERM to make, which must stop every
    process of the UI within STOP_WITHIN_S seconds (`_sigterm_stops_everything`: a failure of the module's
    teardown otherwise)."""
    port = free_port()
    home = tmp_path / "dagster-home"
    home.mkdir()
    shutil.copyfile(REPO / "pipelines" / "orchestration" / "dagster.yaml", home / "dagster.yaml")
    demo_env = f"DAGSTER_HOME={home} HIVE_AOT_REGISTRY={registry} HIVE_AOT_STORE={tmp_path / 'store'}"
    # the outer make's flags (`make test`: its jobserver's descriptors) are not this make's
    env = {**{k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
           "HIVE_AOT_CACHE": str(tmp_path / "cache")}
    log = open(tmp_path / "dg-dev.log", "w")
    # `-o setup`: the suite runs in a set-up checkout; DEMO_ENV: the test's instance, registry and store in place
    # of the checkout's. Its own session, so that nothing but the test signals it.
    proc = subprocess.Popen(["make", "--no-print-directory", "-o", "setup", "ui", f"UI_PORT={port}",
                             f"DEMO_ENV={demo_env}"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
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
        try:
            if proc.poll() is None:  # else it failed to start, which the fixture reported
                _sigterm_stops_everything(proc, port)
        finally:
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
    # assets for the one recipe the registry's model lists, none for the packaged recipes no model uses
    assert set(nodes) == {"upstream_revision", "snapshot", "compatibility", "artifact/gguf-f32", "published/gguf-f32",
                          "summary"}
    assert nodes["artifact/gguf-f32"]["hasAssetChecks"] is True
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


def test_the_launcher_stops_its_whole_group_and_kills_what_ignores_sigterm(tmp_path):
    """`make ui`'s launcher (pipelines.orchestration.ui.run_group) with a child group standing in for `dg dev`: a
    child that ignores SIGTERM and a process below it that does not. SIGTERM to the launcher reaches the whole group
    at once; what is left after the grace period is killed; the launcher exits 128 + 15 and says why."""
    stops = tmp_path / "stops.pid"
    group = f"trap '' TERM; (trap - TERM; exec sleep 300) & echo $! > {stops}; sleep 300"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pipelines.orchestration.ui import run_group; "
                               f"sys.exit(run_group(['bash', '-c', {group!r}], grace_s=1.5))"],
        cwd=REPO, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = [launcher.pid]
    try:
        deadline = time.monotonic() + 30
        while not (stops.exists() and stops.read_text().strip()):
            assert launcher.poll() is None and time.monotonic() < deadline, "the stand-in group did not start"
            time.sleep(0.05)
        pids = _descendants(launcher.pid)
        # the launcher, its child (bash, exec'd into its last command: a sleep that ignores SIGTERM), the subshell's
        # sleep that stops on it
        assert len(pids) == 3, pids
        started = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        while _running(int(stops.read_text())):
            assert time.monotonic() - started < 1.0, "SIGTERM did not reach the group"
            time.sleep(0.05)
        assert launcher.poll() is None  # its child ignores it: the launcher waits out the grace period
        assert launcher.wait(10) == 128 + signal.SIGTERM
        took = time.monotonic() - started
        assert launcher.stderr.read().strip() == "Dagster UI stopped (SIGTERM)"
        assert not [p for p in pids if _running(p)]
        assert 1.5 <= took < 5, took  # killed once the grace period was over
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


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
    """GraphQL as the UI drives it (add the partition, launch the model's assets, wait, read the check, the
    staleness, the artifact's metadata and quality, the summary), then headless Chromium on the asset lineage, the
    artifact's partition page, its check and the model's summary, asserting on what a person sees there (the
    metrics beside their thresholds, the charts rendered); screenshots are saved."""
    from webdriver import Browser, browser_missing

    port, root = dagster_ui
    assert _add_partition(port, MODEL) == MODEL
    loc, repo = _repository(port)
    keys = [["snapshot"], ["compatibility"], ["artifact", "gguf-f32"], ["published", "gguf-f32"], ["summary"]]
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
        {path: ["summary"]}]) { assetKey { path } staleStatus(partition: $p) } }""", {"p": MODEL})
    status_of = {"/".join(n["assetKey"]["path"]): n["staleStatus"] for n in stale["assetNodes"]}
    assert status_of == {"published/gguf-f32": "FRESH", "summary": "FRESH"}
    build_id, full_id = _artifact_metadata(port)
    _quality_recorded(port, full_id)

    why = browser_missing()
    if why:  # `make setup` installs Chromium: its absence is a failure unless skipping was asked for
        if os.environ.get("HIVE_AOT_SKIP_BROWSER"):
            pytest.skip(f"browser part (HIVE_AOT_SKIP_BROWSER): {why}")
        pytest.fail(f"the browser part cannot run: {why}; set HIVE_AOT_SKIP_BROWSER=1 to skip it knowingly")
    SCREENSHOTS.mkdir(exist_ok=True)
    browser = Browser()
    try:
        _read_the_pages(browser, f"http://127.0.0.1:{port}", build_id, full_id)
    finally:
        browser.close()
    for name in SHOTS:
        assert (SCREENSHOTS / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


ENTRIES = """metadataEntries { label ... on TextMetadataEntry { text } ... on JsonMetadataEntry { jsonString }
    ... on MarkdownMetadataEntry { mdStr } ... on FloatMetadataEntry { floatValue }
    ... on TableMetadataEntry { table { records schema { columns { name } } } } }"""


def _entries(events: list[dict]) -> dict[str, dict]:
    (event,) = events
    return {e["label"]: e for e in event["metadataEntries"]}


def _artifact_metadata(port: int) -> tuple[str, str]:
    """The artifact's materialization as the partition page lists it: the build id cut to 12 hex digits (the full
    one in the `build` JSON), `files` a table, the peak memory once, in binary units. Returns both ids."""
    meta = _graphql(port, f"""query($p: String!) {{ assetNodes(assetKeys: [{{path: ["artifact", "gguf-f32"]}}]) {{
        assetMaterializations(partitions: [$p], limit: 1) {{ {ENTRIES} }} }} }}""", {"p": MODEL})
    entries = _entries(meta["assetNodes"][0]["assetMaterializations"])
    build_id, full_id = entries["build_id"]["text"], json.loads(entries["build"]["jsonString"])["build_id"]
    assert len(build_id) == 12 and len(full_id) == 64 and full_id.startswith(build_id)
    files = [json.loads(r) for r in entries["files"]["table"]["records"]]
    assert len(files) == 1 and files[0]["path"].endswith(".gguf") and files[0]["size"].endswith("MiB"), files
    assert "peak_memory_estimate" not in entries and entries["peak_memory"]["text"].split(" (")[0].endswith("iB")
    return build_id, full_id


def _quality_recorded(port: int, full_id: str) -> None:
    """The parity check recorded what it measured on the artifact's partition (an observation: the partition page
    lists it beside the build's metadata) and the summary holds the model's row and the size/quality chart."""
    obs = _graphql(port, f"""query($p: String!) {{ assetNodes(assetKeys: [{{path: ["artifact", "gguf-f32"]}}]) {{
        assetObservations(partitions: [$p], limit: 1) {{ {ENTRIES} }} }} }}""", {"p": MODEL})
    seen = _entries(obs["assetNodes"][0]["assetObservations"])
    assert seen["validation"]["text"].startswith("passed: ")
    gates = {r["metric"]: r for r in map(json.loads, seen["quality"]["table"]["records"])}
    assert gates["top-1 agreement"]["threshold"] == "≥ 0.99" and gates["mean KL"]["threshold"] == "≤ 0.001"
    assert all(g["pass"] for g in gates.values()) and float(gates["top-1 agreement"]["value"]) >= 0.99
    assert f'{seen["top1_agreement"]["floatValue"]:.4f}' == gates["top-1 agreement"]["value"]  # and as a number
    assert seen["kl_by_position"]["mdStr"].startswith("![KL by position](<data:image/svg+xml,")
    summary = _graphql(port, f"""query($p: String!) {{ assetNodes(assetKeys: [{{path: ["summary"]}}]) {{
        assetMaterializations(partitions: [$p], limit: 1) {{ {ENTRIES} }} }} }}""", {"p": MODEL})
    table = _entries(summary["assetNodes"][0]["assetMaterializations"])
    (row,) = [json.loads(r) for r in table["recipes"]["table"]["records"]]
    assert (row["recipe"], row["state"], row["build id"]) == ("gguf-f32", "published", full_id[:12]), row
    assert row["top1"] == gates["top-1 agreement"]["value"] and row["size"].endswith("MiB")
    assert table["size_vs_quality"]["mdStr"].startswith("![size against mean KL](<data:image/svg+xml,")


SHOTS = ("ui-lineage.png", "ui-partition.png", "ui-check.png", "ui-summary.png")

# The charts' images on a page: (alt text, whether a data: SVG, its rendered width), as Chromium decoded them.
IMAGES = "return [...document.images].map(i => [i.alt, i.src.startsWith('data:image/svg+xml,'), i.naturalWidth])"


def _read_the_pages(browser, base: str, build_id: str, full_id: str) -> None:
    """Headless Chromium on the lineage, the artifact's partition page (its build and, from the check, each metric
    with its threshold and the KL-by-position chart), the parity check and the model's summary, asserting on what a
    person sees there; screenshots saved."""
    browser.open(f"{base}/assets/artifact/gguf-f32?view=lineage")
    # a fresh profile gets Dagster's "Join the Dagster community" dialog over the page: dismiss it
    browser.wait_for_text("Join the Dagster community", timeout=60)
    assert browser.click_text("Skip")
    # the artifact between its sources and its publish step (group "publish"), its check passed
    text = browser.wait_for_text("snapshot", "compatibility", "sources", "publish", "gguf-f32", "2 / 2 Passed")
    assert "Join the Dagster community" not in text
    browser.screenshot(SCREENSHOTS / "ui-lineage.png")

    partition = MODEL.replace("/", "%2F")
    browser.open(f"{base}/assets/artifact/gguf-f32?view=partitions&partition={partition}")
    text = browser.wait_for_text(MODEL, "Materialized", "build_id", build_id, "size", "MiB", "store_uri", ".gguf",
                                 "peak_memory", "quality", "kl_by_position")
    # the gate table and the chart below it in view
    browser.script("document.querySelector('img[alt=\"KL by position\"]').scrollIntoView({block: 'end'})")
    browser.screenshot(SCREENSHOTS / "ui-partition.png")
    # each gate in a row of its own: metric, measured value, threshold, pass
    assert re.search(r"top-1 agreement\t[01]\.\d{4}\t≥ 0\.99\ttrue", text), text
    assert re.search(r"mean KL\t\d\.\d{5}\t≤ 0\.001\ttrue", text), text
    # the id cut to 12 hex digits in its row; the full one only in the `build` JSON entry
    assert re.search(rf"\nbuild_id\s+{build_id}\s", text) and f'"build_id": "{full_id}"' in text, text
    assert ["KL by position", True] in [i[:2] for i in browser.script(IMAGES) if i[2] > 0]

    browser.open(f"{base}/assets/artifact/gguf-f32?view=checks")
    # two blocking checks, both passed; the integrity one says what it verified
    browser.wait_for_text("Checks (2)", "integrity", "numerical_parity", "every blob intact")
    assert browser.click_text("numerical_parity")
    text = browser.wait_for_text("numerical_parity", "This is a blocking asset check", "Passed", MODEL,
                                 "top1_agreement", "mean_kl", "max_abs_logit_delta", "parity",
                                 "gate: top-1 agreement", "gate: mean KL")
    browser.screenshot(SCREENSHOTS / "ui-check.png")
    # each value against its threshold, in the check's own visible metadata
    assert re.search(r"gate: top-1 agreement\s+[01]\.\d{4} ≥ 0\.99: pass", text), text
    assert re.search(r"gate: mean KL\s+\d\.\d{5} ≤ 0\.001: pass", text), text

    browser.open(f"{base}/assets/summary?view=partitions&partition={partition}")
    browser.wait_for_text(MODEL, "recipes", "gguf-f32", "published", build_id, "size_vs_quality")
    browser.screenshot(SCREENSHOTS / "ui-summary.png")
    assert ["size against mean KL", True] in [i[:2] for i in browser.script(IMAGES) if i[2] > 0]
