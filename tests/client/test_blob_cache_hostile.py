"""A shared pull cache is writable by others: what it holds is untrusted input (red team round two, items 8,
9, 10 and 13). Nothing planted in it may make a pull write, truncate or chmod a file outside it, hang, or end
in a traceback; a full disk is the DiskFull line; what killed pulls leave is reclaimed by `gc`."""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipelines.client.blob_cache import MIN_PART_BYTES, PART_SIZE_ENV, blob_path, fetch_blob, missing_bytes, part_bytes_setting
from pipelines.client.blob_leftovers import reclaim_partials
from pipelines.core.errors import HiveError
from pipelines.core.hashing import sha256_file
from pipelines.store import open_store
from pipelines.store.layout import manifest_key, ref_key
from pipelines.store.manifest import FileEntry, Manifest, ModelInfo, RecipeInfo

PART = 64 << 10
SIZE = 3 * PART + 17
MODEL = "test-org/hostile-cache"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HIVE_AOT_CACHE", str(root))
    return root


@pytest.fixture
def blob(tmp_path):
    store = open_store(str(tmp_path / "store"))
    f = tmp_path / "blob.bin"
    f.write_bytes(random.Random(3).randbytes(SIZE))
    return store, store.put_blob(f)


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "outside" / "victim.txt"
    v.parent.mkdir(exist_ok=True)
    v.write_bytes(b"not the cache's" * (SIZE // 15 + 1))
    os.chmod(v, 0o600)
    return v


def _sidecar(digest: str, suffix: str) -> Path:
    return blob_path(digest).with_name(f".{digest}.{suffix}")


@pytest.mark.parametrize("planted", ["partial", "parts", "parts.tmp", "lock", "blob", "fanout-dir"])
def test_a_symlink_planted_in_the_cache_is_never_written_through(planted, cache, blob, tmp_path):
    store, digest = blob
    victim = _victim(tmp_path)
    before = (victim.read_bytes(), stat.S_IMODE(victim.stat().st_mode))
    target = blob_path(digest)
    target.parent.mkdir(parents=True)
    if planted == "fanout-dir":  # blobs/sha256/<2 hex> itself a link to a directory elsewhere
        target.parent.rmdir()
        target.parent.symlink_to(victim.parent, target_is_directory=True)
    elif planted == "blob":  # a file elsewhere with the blob's very bytes: a cache hit would chmod it 0644
        victim.write_bytes(random.Random(3).randbytes(SIZE))
        before = (victim.read_bytes(), stat.S_IMODE(victim.stat().st_mode))
        target.symlink_to(victim)
    else:
        _sidecar(digest, planted).symlink_to(victim)
        if planted in ("parts", "parts.tmp"):  # a resumable-looking partial beside it
            _sidecar(digest, "partial").write_bytes(b"\0" * SIZE)
    path = fetch_blob(store, digest, SIZE, part_bytes=PART)
    assert sha256_file(path) == digest and not path.is_symlink() and not path.parent.is_symlink()
    assert (victim.read_bytes(), stat.S_IMODE(victim.stat().st_mode)) == before
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]


@pytest.mark.parametrize("part_list", ["[]", '"done"', "[" * 100_000 + "]" * 100_000, '{"done": {"0": 1}}',
                                        '{"done": [1e400, -1, true, "0"], "part_bytes": 1}', "\xff\xfe", "fifo"])
def test_a_malformed_part_list_restarts_the_download_without_a_traceback(part_list, cache, blob):
    store, digest = blob
    blob_path(digest).parent.mkdir(parents=True)
    _sidecar(digest, "partial").write_bytes(b"\1" * SIZE)  # wrong bytes: resuming from them would not verify
    state = _sidecar(digest, "parts")
    if part_list == "fifo":
        os.mkfifo(state)  # reading it would block forever
    else:
        state.write_bytes(part_list.encode("utf-8", "surrogateescape"))
    assert missing_bytes(digest, SIZE) == SIZE
    done: list[Path] = []
    t = threading.Thread(target=lambda: done.append(fetch_blob(store, digest, SIZE, part_bytes=PART)), daemon=True)
    t.start()
    t.join(60)
    assert done and sha256_file(done[0]) == digest


@pytest.mark.parametrize("where", ["blob", "partial", "fanout"])
def test_the_wrong_kind_of_entry_in_the_cache_is_one_line(where, cache, blob, tmp_path, monkeypatch):
    store, digest = blob
    target = blob_path(digest)
    if where == "fanout":  # a file where blobs/sha256/<2 hex>/ belongs
        target.parent.parent.mkdir(parents=True)
        target.parent.write_text("x")
    else:
        (target if where == "blob" else _sidecar(digest, "partial")).mkdir(parents=True)
    with pytest.raises(HiveError) as ei:
        fetch_blob(store, digest, SIZE, part_bytes=PART)
    msg = str(ei.value)
    assert "\n" not in msg and "blob cache" in msg and str(target.parent.name) in msg, msg


def _publish(store_dir: Path, digest: str) -> str:
    store = open_store(str(store_dir))
    m = Manifest(build_id="cd" * 32, model=ModelInfo(id=MODEL, revision="r", commit="c", source="s",
                                                     content_digest="ab" * 32),
                 recipe=RecipeInfo(id="gguf-f16", kind="gguf", digest="ef" * 32, options={}),
                 runtime_profiles=["llm-llamacpp-cpu"], format="gguf",
                 files=[FileEntry(path="m.gguf", sha256=digest, size=SIZE)], toolchain={})
    raw = m.to_bytes()
    key = manifest_key(MODEL, "gguf-f16", m.build_id)
    store.write_bytes(key, raw)
    store.write_bytes(ref_key(MODEL, "gguf-f16", "latest"), json.dumps(
        {"build_id": m.build_id, "manifest": key, "manifest_sha256": hashlib.sha256(raw).hexdigest()}).encode())
    return str(store_dir)


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (PART, PART))


def test_a_full_disk_during_a_pull_is_the_disk_full_line(cache, blob, tmp_path):
    """RLIMIT_FSIZE below the blob's size: ftruncate of the partial fails with EFBIG (Python ignores SIGXFSZ),
    as a write on a full disk fails with ENOSPC."""
    _, digest = blob
    store_uri = _publish(tmp_path / "store", digest)
    env = {**os.environ, "HIVE_AOT_CACHE": str(cache)}
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "pull", MODEL, "--target", "llm-llamacpp-cpu",
                          "--dest", str(tmp_path / "out"), "--store", store_uri], env=env, capture_output=True,
                         text=True, timeout=120, preexec_fn=_limit_file_size)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "disk full" in lines[0] and "next pull resumes" in lines[0], res.stderr
    assert not (tmp_path / "out").exists()


def test_gc_reclaims_what_killed_pulls_leave(cache, blob, tmp_path):
    """Item 13: an orphan part list, its temporary and a lock file nobody holds were never reclaimed."""
    _, digest = blob
    store_uri = _publish(tmp_path / "store", digest)
    blob_path(digest).parent.mkdir(parents=True)
    for name in ("parts", "parts.0x1y2z.tmp", "lock"):
        _sidecar(digest, name).write_text("{}")
    other = "9" * 64  # a dead pull of another digest: only its lock is left
    blob_path(other).parent.mkdir(parents=True)
    _sidecar(other, "lock").touch()
    # young leftovers stay (a pull may be about to resume them); a lock nobody holds goes at any age
    assert reclaim_partials() == [f".{other}.lock"]
    env = {**os.environ, "HIVE_AOT_CACHE": str(cache)}
    gc = subprocess.run([sys.executable, "-m", "pipelines.cli", "gc", "--min-age", "0", "--store", store_uri],
                        env=env, capture_output=True, text=True, timeout=120)
    assert gc.returncode == 0, gc.stderr
    assert [p.name for p in (cache / "blobs").rglob(".*")] == []


def test_a_one_byte_part_size_is_clamped(monkeypatch):
    monkeypatch.setenv(PART_SIZE_ENV, "1")
    assert part_bytes_setting() == MIN_PART_BYTES
    monkeypatch.setenv(PART_SIZE_ENV, "1" * 400)
    with pytest.raises(HiveError, match=PART_SIZE_ENV):
        part_bytes_setting()
