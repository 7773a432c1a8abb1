"""Fault loops on a real store (local directory, SeaweedFS S3, a docker-registry OCI store), on a tiny artifact:

- `hive-aot build` killed (SIGKILL to its whole process group, as a container kill does) at the store's own
  events (`pipelines/store/faults.py`: a blob, the staging record, the manifest, each ref, half-written and
  just visible), 20 times per store kind, each kill meeting what the ones before it left: after every kill no
  ref names a manifest that is missing or that does not match the sha256 the ref records, and no manifest
  names a missing or short blob; a last build completes; then `gc` leaves no work directory, partial or
  temporary behind.
- 6 publishers of one build at once (each with its own cache, holding the model's reference as a host that
  built it before would), and 6 pullers on one cache at once: all succeed, the manifest is written once in
  identical bytes, the blob is downloaded once.
- wrong credentials, a missing bucket, an unknown model or tag: one line each, and no secret in it.

Every build starts from a cache holding the model's transformers reference (computed once per module, as a host
that built the model before holds it): the loops spend their time on the store, not on the reference. Every CLI
run is forked by a warm server that has imported hive-aot (tests/support/warm_cli.py): each is still a process of its own,
in a session of its own, killed whole, and the six publishers (and pullers) start within milliseconds of each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from factories import make_spm_llama, write_test_config
from warm_cli import run_cli

from pipelines.store import blob_key, open_store
from pipelines.store.faults import EVENTS_ENV, KILL_ENV
from pipelines.store.manifest import Manifest

REPO = Path.cwd()
MODEL = "test-org/faulty"
PUBLISHER_KILLS = 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return {"model": make_spm_llama(root / "model"), "registry": write_test_config(root / "cfg", REPO)}


def _store_uri(kind: str, tmp_path: Path, request) -> str:
    if kind == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_uri" if kind == "s3" else "oci_uri")


def check_store(uri: str) -> dict[str, int]:
    """The store's invariants: every ref names an existing manifest with the sha256 it records, and every file
    of every manifest is a blob of the recorded size. Returns what it saw."""
    store = open_store(uri)
    refs = store.list("refs/")
    for key in refs:
        ref = store.read_ref(key)
        raw = store.read_bytes(ref["manifest"])
        assert raw is not None, f"{key} names a missing manifest {ref['manifest']}"
        assert hashlib.sha256(raw).hexdigest() == ref["manifest_sha256"], key
    manifests = store.list("manifests/")
    for key in manifests:
        for f in Manifest.parse(store.read_bytes(key), key).files:
            assert store.size(blob_key(f.sha256)) == f.size, f"{key}: blob {f.sha256[:12]} missing or short"
    return {"refs": len(refs), "manifests": len(manifests)}


def _build_args(model: dict, uri: str, recipe: str = "gguf-f16") -> list[str]:
    return ["build", str(model["model"]), "--recipe", recipe, "--model-id", MODEL, "--store", uri, "--registry",
            str(model["registry"]), "--json"]


def _events_of_a_build(model: dict, env: dict[str, str], store: str, tmp_path: Path) -> list[str]:
    """The store events (`pipelines/store/faults.py`) of one whole build into an empty store, in order."""
    record = tmp_path / "events.txt"
    full = run_cli(_build_args(model, store), {**env, EVENTS_ENV: str(record)}, timeout=300)
    assert full.returncode == 0, full.stderr
    return record.read_text().split()


@pytest.fixture(scope="module")
def warm_cache(model, tmp_path_factory) -> Path:
    """A cache holding the model's transformers reference and tokenizer answers, from one build into a scratch
    store. Each test's builds start from a copy, as a host that built this model before would: the fault loops
    and the six concurrent publishers contend for the store, not for two cores computing references."""
    root = tmp_path_factory.mktemp("warm")
    env = {**os.environ, "HIVE_AOT_CACHE": str(root / "cache")}
    built = run_cli(_build_args(model, str(root / "store")), env, timeout=300)
    assert built.returncode == 0, built.stderr
    assert {p.name for p in (root / "cache").iterdir()} >= {"reference", "tokenizer-answers"}
    return root / "cache"


def _cache_copy(warm: Path, dest: Path) -> Path:
    for part in ("reference", "tokenizer-answers"):
        shutil.copytree(warm / part, dest / part)
    return dest


@pytest.mark.parametrize("kind", ["local", "s3", "oci"])
def test_killed_publishers_never_leave_a_ref_to_nothing(kind, model, warm_cache, tmp_path, request, record_property):
    uri = _store_uri(kind, tmp_path, request)  # first: the S3 server's AWS_* variables go into env below
    cache = _cache_copy(warm_cache, tmp_path / "cache")
    env = {**os.environ, "HIVE_AOT_CACHE": str(cache)}
    events = _events_of_a_build(model, env, f"{uri}-calibration", tmp_path)
    areas = {e.split(":", 1)[1].split("#")[0] for e in events}
    assert {"blobs", "staging", "manifests", "refs"} <= areas, events
    # Every trial kills the build (SIGKILL to its process group) at the next event of a whole build's sequence,
    # in order, in the same store: each kill meets the state the kills before it left (a blob uploaded, a
    # candidate staged, a manifest without refs, one ref of two) and must keep the store consistent from there.
    # An event the resumed build no longer reaches (its blob is already there) lets it finish: published, and
    # the sequence goes on in a fresh store.
    kills, published, stores, at = 0, 0, [uri], 0
    killed_at: list[str] = []
    while kills < PUBLISHER_KILLS:
        event = events[at % len(events)]
        at += 1
        proc = run_cli(_build_args(model, stores[-1]), {**env, KILL_ENV: event}, timeout=300)
        if proc.returncode == -signal.SIGKILL:
            kills += 1
            killed_at.append(event)
        else:
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert json.loads(proc.stdout)["state"] in ("published", "skipped")
            published += 1
            stores.append(f"{uri}-{published}")
        check_store(stores[-1])
        assert at < 3 * PUBLISHER_KILLS, f"only {kills} of {at} trials were killed: {killed_at}"
    for s in stores:  # a last build of every store completes, from whatever the kills left
        done = run_cli(_build_args(model, s), env, timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["state"] in ("published", "skipped")
        assert check_store(s) == {"refs": 2, "manifests": 1}  # latest + the revision tag
    gc = run_cli(["gc", "--min-age", "0", "--store", stores[-1]], env, timeout=120)
    assert gc.returncode == 0, gc.stderr
    work = cache / "work"
    left_work = [p.name for p in work.iterdir() if p.is_dir()] if work.exists() else []
    assert left_work == [], left_work  # the killed builds' scratch directories were reclaimed
    leftovers = [p for p in Path(stores[-1]).rglob(".*")] if kind == "local" else []
    assert leftovers == [], leftovers
    # every kind of point was hit: a blob and a record half-written and just visible, a manifest without its refs
    hit = {e.split("#")[0] for e in killed_at}
    assert {"temp:blobs", "done:blobs", "temp:manifests", "done:manifests", "done:refs"} <= hit, killed_at
    summary = (f"publisher kills ({kind}): {kills} at store events ({len(events)} in a whole build: "
               f"{', '.join(sorted(set(e.split('#')[0] for e in events)))}), {published} builds finished; "
               "invariants held after each, gc left no work dir")
    record_property("fault_loop", summary)  # tests/run.py prints it in make test's summary
    print(summary)


def _at_once(runs: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[tuple[int, str, str]]:
    """CLI runs (arguments, environment) started together, each a process of its own: (status, stdout, stderr)."""
    with ThreadPoolExecutor(len(runs)) as pool:
        done = list(pool.map(lambda run: run_cli(*run, timeout=timeout), runs))
    return [(p.returncode, p.stdout, p.stderr) for p in done]


@pytest.mark.parametrize("kind", ["local", "s3", "oci"])
def test_six_publishers_of_one_build_and_six_pullers_of_one_blob(kind, model, warm_cache, tmp_path, request):
    uri = _store_uri(kind, tmp_path, request)
    env = {**os.environ, "HIVE_AOT_CACHE": str(tmp_path / "cache")}
    caches = [_cache_copy(warm_cache, tmp_path / f"cache-{i}") for i in range(6)]
    results = _at_once([(_build_args(model, uri), {**env, "HIVE_AOT_CACHE": str(cache)}) for cache in caches], 600)
    assert all(rc == 0 for rc, _, _ in results), [err[-500:] for rc, _, err in results if rc]
    docs = [json.loads(out) for _, out, _ in results]
    assert len({d["build_id"] for d in docs}) == 1 and {d["state"] for d in docs} <= {"published", "skipped"}
    assert check_store(uri) == {"refs": 2, "manifests": 1}
    pull_env = {**env, "HIVE_AOT_CACHE": str(tmp_path / "pull-cache")}
    outs = _at_once([(["pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / f"dest-{i}"), "--store",
                       uri, "--json"], pull_env) for i in range(6)], 300)
    assert all(rc == 0 for rc, _, _ in outs), [err[-500:] for rc, _, err in outs if rc]
    moved = [json.loads(out)["transfer"] for _, out, _ in outs]
    size = json.loads(outs[0][1])["size"]
    # one puller downloaded it; the others waited on its lock and found it in the cache
    assert sum(m["fetched_bytes"] for m in moved) == size and sorted(m["cached_blobs"] for m in moved) == [0] + [1] * 5


def _one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hive-aot: error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_wrong_credentials_missing_bucket_unknown_model_and_tag_are_one_line(model, warm_cache, s3_uri, tmp_path):
    from s3_server import SECRET_KEY

    env = {**os.environ, "HIVE_AOT_CACHE": str(_cache_copy(warm_cache, tmp_path / "cache"))}
    built = run_cli(_build_args(model, s3_uri), env, timeout=300)
    assert built.returncode == 0, built.stderr

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return run_cli(list(args), {**env, **extra}, timeout=120)

    pull = ("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "m"), "--store", s3_uri)
    wrong = "wrong-secret-5d0e"
    line = _one_line(cli(*pull, AWS_SECRET_ACCESS_KEY=wrong), "credentials refused")
    assert wrong not in line and SECRET_KEY not in line
    line = _one_line(cli("ls", "--store", s3_uri, AWS_ACCESS_KEY_ID="nobody-here"), "credentials refused")
    assert SECRET_KEY not in line
    _one_line(cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "n"),
                  "--store", "s3://no-such-bucket-anywhere/x"), "no-such-bucket-anywhere")
    _one_line(cli("pull", "test-org/never-built", "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "o"),
                  "--store", s3_uri), "test-org/never-built: nothing published with tag 'latest'")
    _one_line(cli(*pull, "--tag", "v9"), f"{MODEL}: nothing published with tag 'v9'")
    assert not any((tmp_path / d).exists() for d in "mno")
