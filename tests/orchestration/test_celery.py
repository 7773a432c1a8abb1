"""Distributed execution for real: the onboarding of a tiny model on Dagster's Celery executor, with a Redis
broker on 127.0.0.1 (Debian's redis-server, installed by `make setup`) and two Celery workers started the way
a deployment starts them (`dagster-celery worker start`). Every step runs as a Celery task in a worker
process, not in the launching process; the steps exchange store URIs and build ids only."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import psutil
import pytest
import yaml
from factories import SMOLLM2_PRE, make_llama
from processes import free_port, stop_group

REPO = Path.cwd()
BIN = Path(sys.executable).parent
MODEL = "test/celery"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is missing: `make setup` installs Debian's redis-server")
    port = free_port()
    log = tmp_path_factory.mktemp("redis") / "redis.log"
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--logfile", str(log)], start_new_session=True)
    deadline = time.time() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"redis-server did not start: {log.read_text()[-2000:] if log.exists() else ''}")
        time.sleep(0.2)
    yield f"redis://127.0.0.1:{port}/0"
    stop_group(proc)


def test_onboarding_runs_on_two_celery_workers(tmp_path, smollm2_small_vocab_dir, redis_url):
    # a 2-layer Llama on SmolLM2's BPE cut to 2,048 tokens: the recipes name its pre-tokenizer
    tiny_llama = make_llama(tmp_path / "tiny-llama", smollm2_small_vocab_dir)
    home = tmp_path / "dagster"
    home.mkdir()
    shutil.copyfile(REPO / "pipelines" / "orchestration" / "dagster.yaml", home / "dagster.yaml")
    recipes = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes", recipes)
    f16 = yaml.safe_load((recipes / "gguf-f16.yaml").read_text())
    f16["options"] = {**f16.get("options", {}), "bpe_pre_fallback": SMOLLM2_PRE}
    (recipes / "gguf-f16.yaml").write_text(yaml.safe_dump(f16))
    (recipes / "gguf-f32.yaml").write_text(yaml.safe_dump({
        "id": "gguf-f32", "kind": "gguf", "options": {"outtype": "f32", "bpe_pre_fallback": SMOLLM2_PRE},
        "runtime_profiles": ["llm-llamacpp-cpu"], "validation": {"min_top1_agreement": 0.99, "max_mean_kl": 0.001}}))
    reg = yaml.safe_load((REPO / "registry.yaml").read_text())
    reg.update(recipes_dir=str(recipes), models=[{"id": MODEL, "source": str(tiny_llama),
                                                  "recipes": ["gguf-f16", "gguf-f32"]}])
    (tmp_path / "registry.yaml").write_text(yaml.safe_dump(reg))
    store = tmp_path / "store"
    env = {**os.environ, "DAGSTER_HOME": str(home), "HIVE_AOT_REGISTRY": str(tmp_path / "registry.yaml"),
           "HIVE_AOT_STORE": str(store), "HIVE_AOT_CELERY_BROKER": redis_url, "HIVE_AOT_CACHE": str(tmp_path / "cache"),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    worker_config = tmp_path / "celery.yaml"
    worker_config.write_text(yaml.safe_dump({"execution": {"config": {"broker": redis_url, "backend": redis_url}}}))

    # The instance's SQLite storage is created here, once, before any other process opens it: workers and the
    # launcher creating it at the same time race on its schema migration.
    instance = dg.DagsterInstance.from_config(str(home))
    instance.add_dynamic_partitions("models", [MODEL])
    workers, logs = [], []
    try:
        for name in ("w1", "w2"):
            logs.append(open(tmp_path / f"{name}.log", "w"))
            # solo pool: the task runs in the worker's own process, so each step's events carry that pid
            workers.append(subprocess.Popen(
                [str(BIN / "dagster-celery"), "worker", "start", "-A", "dagster_celery.app", "-y", str(worker_config),
                 "-n", name, "--", "-P", "solo"], cwd=tmp_path, env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                start_new_session=True))
        selection = ",".join(["snapshot", "compatibility", "artifact/gguf-f16", "published/gguf-f16",
                              "artifact/gguf-f32", "published/gguf-f32"])
        # Launched as an operator does, from another process: it submits the steps to the broker and waits.
        proc = subprocess.run([str(BIN / "dagster"), "asset", "materialize", "-m", "pipelines.definitions",
                               "--select", selection, "--partition", MODEL], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        worker_logs = "".join((tmp_path / f"{n}.log").read_text() for n in ("w1", "w2"))
        assert proc.returncode == 0, proc.stderr[-4000:] + worker_logs[-4000:]
        # `dagster-celery worker start` runs `celery ... worker` as its child: those are the worker processes
        worker_pids = {c.pid for w in workers for c in psutil.Process(w.pid).children(recursive=True)}
    finally:
        for w in workers:
            stop_group(w)
        for f in logs:
            f.close()

    (run,) = instance.get_runs()
    assert run.is_success
    events = [e.dagster_event for e in instance.all_logs(run.run_id) if e.dagster_event is not None]
    started = {e.step_key: e.pid for e in events if e.event_type_value == "STEP_START"}
    assert set(started) == {"snapshot", "compatibility", "artifact__gguf_f16", "artifact__gguf_f32",
                            "artifact__gguf_f16_numerical_parity", "artifact__gguf_f32_numerical_parity",
                            "artifact__gguf_f16_integrity", "artifact__gguf_f32_integrity",
                            "published__gguf_f16", "published__gguf_f32"}
    # every step ran in one of the two Celery workers, none in the launching `dagster` process
    assert set(started.values()) <= worker_pids, (started, worker_pids)
    counts = {pid: list(started.values()).count(pid) for pid in set(started.values())}
    print(f"steps per worker process: {counts}")
    checks = {e.event_specific_data.asset_check_key.to_user_string(): e.event_specific_data.passed
              for e in events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert checks == {f"artifact/{r}:{c}": True for r in ("gguf-f16", "gguf-f32") for c in ("numerical_parity", "integrity")}
    slug = MODEL.replace("/", "--")
    for rid in ("gguf-f16", "gguf-f32"):
        assert (store / "refs" / slug / rid / "latest").is_file()
        (manifest,) = (store / "manifests" / slug / rid).glob("*.json")
        assert json.loads(manifest.read_text())["validation"]["passed"] is True
