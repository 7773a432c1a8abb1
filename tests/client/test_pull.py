"""Pull: ref -> manifest -> verified blobs -> DIR, as a serving container runs it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import CPU_PREFERENCE, rewrite_published_manifest, write_test_config

from pipelines.client.blob_stamps import identity
from pipelines.client.pull import MARKER, pull
from pipelines.config.registry import Config
from pipelines.core.errors import HiveError, IntegrityError, StoreError
from pipelines.engine.build import build_and_publish

REPO = Path.cwd()
MODEL = "test-org/tiny-llama"
SLUG = "test-org--tiny-llama"
CPU = "llm-llamacpp-cpu"


@pytest.fixture(scope="module")
def env(tiny_llama, tmp_path_factory):
    """f16 and q4_k_m of the tiny model published in one store (lenient gates for the 4-bit random model)."""
    root = tmp_path_factory.mktemp("pull")
    reg = write_test_config(root / "cfg", REPO)
    config = Config.load(reg)
    store = root / "store"
    builds = {r: build_and_publish(str(tiny_llama), r, config, str(store), MODEL) for r in ("gguf-f16", "gguf-q4_k_m")}
    assert {r: b.state for r, b in builds.items()} == {"gguf-f16": "published", "gguf-q4_k_m": "published"}
    return {"store": store, "registry": reg, "builds": builds, "config": config}
KEPT = "hive-aot.manifest.json"  # the manifest's exact bytes, which every pulled DIR holds beside its files


def _siblings(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir()) if dest.parent.exists() else []


def test_profile_preference_picks_q4_k_m(env, tmp_path):
    dest = tmp_path / "model"
    res = pull(MODEL, CPU, dest, store_uri=str(env["store"]), registry=str(env["registry"]))
    q4 = env["builds"]["gguf-q4_k_m"]
    assert res.recipe == "gguf-q4_k_m" and res.build_id == q4.build_id
    assert res.already_present is False and res.runtime_profile == CPU
    assert res.files == [str(dest / "tiny-llama-Q4_K_M.gguf")]
    assert res.serve.startswith(f"llama-server -m {dest / 'tiny-llama-Q4_K_M.gguf'} -c ")


def test_recipe_flag_and_build_id(env, tmp_path):
    f16 = env["builds"]["gguf-f16"]
    res = pull(MODEL, CPU, tmp_path / "a", recipe="gguf-f16", store_uri=str(env["store"]))
    assert res.recipe == "gguf-f16" and res.build_id == f16.build_id
    res = pull(f"{MODEL}@{f16.build_id}", CPU, tmp_path / "b", store_uri=str(env["store"]))
    assert res.recipe == "gguf-f16" and res.build_id == f16.build_id
    q4 = env["builds"]["gguf-q4_k_m"]
    res = pull(f"{MODEL}@{q4.build_id}", CPU, tmp_path / "c", store_uri=str(env["store"]))
    assert res.recipe == "gguf-q4_k_m"
    with pytest.raises(HiveError, match=f"{MODEL}: nothing published with build {'0' * 64}"):
        pull(f"{MODEL}@{'0' * 64}", CPU, tmp_path / "d", store_uri=str(env["store"]))
    # the revision tag works too
    rev = json.loads((env["store"] / f"manifests/{SLUG}/gguf-f16/{f16.build_id}.json").read_text())["model"]["revision"]
    res = pull(MODEL, CPU, tmp_path / "e", tag=rev, recipe="gguf-f16", store_uri=str(env["store"]))
    assert res.build_id == f16.build_id
    assert not (tmp_path / "d").exists()


def test_dest_holds_manifest_files_and_marker(env, tmp_path):
    dest = tmp_path / "srv" / "model"
    pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]), registry=str(env["registry"]))
    f16 = env["builds"]["gguf-f16"]
    # the build's files, the marker, and the manifest's exact bytes (unsigned build: no model.sig)
    assert sorted(p.name for p in dest.iterdir()) == sorted([f16.files[0]["path"], MARKER, KEPT])
    assert (dest / "hive-aot.manifest.json").read_bytes() == (
        env["store"] / f"manifests/{SLUG}/gguf-f16/{f16.build_id}.json").read_bytes()
    assert _siblings(dest) == ["model"]  # no temporaries next to it
    blob = env["store"] / f"blobs/sha256/{f16.files[0]['sha256'][:2]}/{f16.files[0]['sha256']}"
    assert (dest / f16.files[0]["path"]).read_bytes() == blob.read_bytes()
    marker = json.loads((dest / MARKER).read_text())
    assert marker["build_id"] == f16.build_id and marker["model_id"] == MODEL and marker["recipe"] == "gguf-f16"
    assert marker["runtime_profile"]["id"] == CPU
    assert marker["serving"]["engine"] == "llama.cpp" and marker["serving"]["n_threads"] == "auto"
    assert marker["serving"]["model_file"] == f16.files[0]["path"]
    stored = json.loads((env["store"] / f"manifests/{SLUG}/gguf-f16/{f16.build_id}.json").read_text())
    assert marker["manifest"] == stored


def test_repull_is_a_noop_and_switching_recipe_replaces(env, tmp_path):
    dest = tmp_path / "model"
    first = pull(MODEL, CPU, dest, store_uri=str(env["store"]))
    gguf = Path(first.files[0])
    stamp = (gguf.stat().st_ino, gguf.stat().st_mtime_ns, (dest / MARKER).stat().st_mtime_ns)
    again = pull(MODEL, CPU, dest, store_uri=str(env["store"]))
    assert again.already_present is True and again.build_id == first.build_id
    assert (gguf.stat().st_ino, gguf.stat().st_mtime_ns, (dest / MARKER).stat().st_mtime_ns) == stamp

    other = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    assert other.already_present is False and other.recipe == "gguf-f16"
    assert sorted(p.name for p in dest.iterdir()) == sorted(["tiny-llama-F16.gguf", MARKER, KEPT])
    assert _siblings(dest) == ["model"]

    # a DIR whose files were damaged is not "already present": it is pulled again
    (dest / "tiny-llama-F16.gguf").unlink()
    fixed = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    assert fixed.already_present is False and (dest / "tiny-llama-F16.gguf").is_file()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_blob_is_refused_and_dest_not_created(env, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "fresh-cache"))  # nothing cached from earlier pulls
    store = tmp_path / "store"
    shutil.copytree(env["store"], store)
    f = env["builds"]["gguf-q4_k_m"].files[0]
    blob = store / f"blobs/sha256/{f['sha256'][:2]}/{f['sha256']}"
    data = bytearray(blob.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[:-1]
    blob.write_bytes(bytes(data))
    dest = tmp_path / "out" / "model"
    with pytest.raises(IntegrityError, match=f"blob {f['sha256'][:12]} .* does not match its manifest sha256") as ei:
        pull(MODEL, CPU, dest, store_uri=str(store))
    assert "\n" not in str(ei.value)
    assert not dest.exists()
    assert _siblings(dest) == []  # no partial DIR next to it
    cached = [p for p in (tmp_path / "fresh-cache").rglob("*") if p.is_file()]
    assert cached == []  # and no partial blob in the cache


def test_tampered_manifest_is_refused(env, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(env["store"], store)
    b = env["builds"]["gguf-f16"]
    mpath = store / f"manifests/{SLUG}/gguf-f16/{b.build_id}.json"
    mpath.write_bytes(mpath.read_bytes().replace(b'"n_ctx":512', b'"n_ctx":513'))
    with pytest.raises(IntegrityError, match="does not match the sha256 its ref records"):
        pull(MODEL, CPU, tmp_path / "model", recipe="gguf-f16", store_uri=str(store))
    assert not (tmp_path / "model").exists()


def test_refuses_to_overwrite_a_foreign_directory(env, tmp_path):
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "precious.txt").write_text("keep me")
    with pytest.raises(HiveError, match="is not empty and was not made by hive-aot pull: refusing to replace it"):
        pull(MODEL, CPU, dest, store_uri=str(env["store"]))
    assert sorted(p.name for p in dest.iterdir()) == ["precious.txt"]
    assert (dest / "precious.txt").read_text() == "keep me"
    assert _siblings(dest) == ["model"]
    # an empty directory is fine
    empty = tmp_path / "empty"
    empty.mkdir()
    assert pull(MODEL, CPU, empty, store_uri=str(env["store"])).recipe == "gguf-q4_k_m"


def test_bad_requests(env, tmp_path):
    store = str(env["store"])
    with pytest.raises(HiveError, match="unknown runtime profile 'tpu-v5'"):
        pull(MODEL, "tpu-v5", tmp_path / "m", store_uri=store)
    with pytest.raises(HiveError, match=r"no published artifact serves vllm-cu121 \(published: gguf-f16"):
        pull(MODEL, "vllm-cu121", tmp_path / "m", store_uri=store)
    with pytest.raises(HiveError, match="no published gguf-q8_0 artifact serves llm-llamacpp-cpu"):
        pull(MODEL, CPU, tmp_path / "m", recipe="gguf-q8_0", store_uri=store)
    with pytest.raises(HiveError, match=r"'tiny-llama' is not a model id: .*\(pull takes org/name\[@build_id\]\)"):
        pull("tiny-llama", CPU, tmp_path / "m", store_uri=store)
    with pytest.raises(HiveError, match="test-org/other: nothing published with tag 'latest'"):
        pull("test-org/other", CPU, tmp_path / "m", store_uri=store)
    with pytest.raises(HiveError, match="nothing published with tag 'v9'"):
        pull(MODEL, CPU, tmp_path / "m", tag="v9", store_uri=store)
    with pytest.raises(HiveError, match=r"store .*/missing-store does not exist \(check --store or \$HIVE_AOT_STORE\)"):
        pull(MODEL, CPU, tmp_path / "m", store_uri=str(tmp_path / "missing-store"))
    (tmp_path / "empty-store").mkdir()
    with pytest.raises(HiveError, match="nothing published"):
        pull(MODEL, CPU, tmp_path / "m", store_uri=str(tmp_path / "empty-store"))
    assert not (tmp_path / "m").exists()


def test_pulled_gguf_loads_and_generates(env, tmp_path):
    from llama_cpp import Llama

    from pipelines.validation import prompts

    res = pull(MODEL, CPU, tmp_path / "model", recipe="gguf-f16", store_uri=str(env["store"]))
    marker = json.loads((tmp_path / "model" / MARKER).read_text())
    expected = marker["manifest"]["validation"]["generation"]["artifact"]
    llm = Llama(model_path=res.files[0], n_ctx=64, n_batch=64, verbose=False, seed=0, n_threads=os.cpu_count() or 1)
    try:
        ids = llm.tokenize(prompts.GENERATION_PROMPT.encode(), add_bos=True, special=True)
        llm.eval(ids)
        gen = []
        for _ in range(prompts.GENERATION_TOKENS):
            nxt = llm.sample(top_k=1, temp=0.0)
            gen.append(nxt)
            if nxt == llm.token_eos():
                break
            llm.eval([nxt])
        # detokenize needs the model: after close() it reads freed memory (a segfault under CI's allocator)
        text = llm.detokenize(gen).decode("utf-8", errors="replace")
    finally:
        llm.close()
    assert len(gen) > 0
    # the same greedy continuation the build's validation recorded (and matched against transformers)
    assert text == expected


def _run_python(code: str, cwd: Path, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HIVE_AOT_REGISTRY"}
    env.update(extra_env)
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_pull_without_registry_uses_the_stores_profiles(env, tmp_path):
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from pipelines.client.pull import pull\n"
        f"res = pull({MODEL!r}, {CPU!r}, Path('dest'), store_uri={str(env['store'])!r})\n"
        "print(json.dumps(res.to_json()))\n"
    )
    assert not (tmp_path / "registry.yaml").exists()
    proc = _run_python(code, tmp_path, {"HIVE_AOT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    # the preference (q4_k_m first) can only have come from the store's profiles.json
    assert res["recipe"] == "gguf-q4_k_m" and res["dest"] == str(tmp_path / "dest")
    marker = json.loads((tmp_path / "dest" / MARKER).read_text())
    assert marker["runtime_profile"]["recipe_preference"] == CPU_PREFERENCE


def test_pull_path_imports_neither_dagster_nor_torch(env, tmp_path):
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pipelines.client.pull import pull\n"
        "from pipelines.cli.main import main\n"
        f"res = pull({MODEL!r}, {CPU!r}, Path('dest'), store_uri={str(env['store'])!r})\n"
        "assert res.recipe == 'gguf-q4_k_m', res\n"
        f"assert main(['pull', {MODEL!r}, '--target', {CPU!r}, '--dest', 'dest2', '--recipe', 'gguf-f16',"
        f" '--store', {str(env['store'])!r}]) == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'torch', 'transformers'))\n"
        "assert 'dagster' not in sys.modules and 'torch' not in sys.modules, heavy\n"
        "print('light', len(heavy))\n"
    )
    proc = _run_python(code, tmp_path, {"HIVE_AOT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["light", "0"]
    assert (tmp_path / "dest2" / "tiny-llama-F16.gguf").is_file()


def test_pulled_files_are_readable_by_other_users(env, tmp_path, monkeypatch):
    """Serving processes run as other users: files 0644, directories 0755, whatever the puller's umask."""
    import stat
    import tempfile

    cache = tmp_path / "cache"
    monkeypatch.setenv("HIVE_AOT_CACHE", str(cache))
    old_umask = os.umask(0o077)
    try:
        # a world-traversable parent, as a serving volume is (pytest's tmp dirs are 0700)
        shared = Path(tempfile.mkdtemp(prefix="hive-aot-served-"))
        os.chmod(shared, 0o755)
        dest = shared / "model"
        res = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
        second = pull(MODEL, CPU, tmp_path / "other", recipe="gguf-f16", store_uri=str(env["store"]))
    finally:
        os.umask(old_umask)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(dest) == 0o755
    assert {p.name: mode(p) for p in dest.iterdir()} == {Path(res.files[0]).name: 0o644, MARKER: 0o644, KEPT: 0o644}
    # the cache's blob is shared by both pulls (one inode) and keeps the served mode
    f = Path(res.files[0])
    blob = next((cache / "blobs").rglob(env["builds"]["gguf-f16"].files[0]["sha256"]))
    assert f.stat().st_ino == blob.stat().st_ino == Path(second.files[0]).stat().st_ino
    assert mode(blob) == 0o644
    if os.geteuid() == 0 and shutil.which("runuser"):
        # the real thing: another user reads the pulled file
        out = subprocess.run(["runuser", "-u", "nobody", "--", "head", "-c4", str(f)], capture_output=True, timeout=30)
        assert out.returncode == 0 and out.stdout == b"GGUF", out.stderr
    shutil.rmtree(shared)


def test_blob_cached_with_an_old_mode_is_fixed_or_copied(env, tmp_path, monkeypatch):
    """Blobs cached by earlier versions were 0600: the next pull serves 0644 files again."""
    import stat

    cache = tmp_path / "cache"
    monkeypatch.setenv("HIVE_AOT_CACHE", str(cache))
    first = pull(MODEL, CPU, tmp_path / "a", recipe="gguf-f16", store_uri=str(env["store"]))
    blob = next((cache / "blobs").rglob(env["builds"]["gguf-f16"].files[0]["sha256"]))
    os.chmod(blob, 0o600)
    assert stat.S_IMODE(Path(first.files[0]).stat().st_mode) == 0o600  # same inode: the old state
    again = pull(MODEL, CPU, tmp_path / "a", recipe="gguf-f16", store_uri=str(env["store"]))
    assert again.already_present is False  # an unreadable directory is not "complete"
    assert stat.S_IMODE(Path(again.files[0]).stat().st_mode) == 0o644


def test_manifest_records_quantization_fallbacks(env):
    q4 = env["builds"]["gguf-q4_k_m"]
    manifest = json.loads((env["store"] / f"manifests/{SLUG}/gguf-q4_k_m/{q4.build_id}.json").read_text())
    fallbacks = manifest["build"]["quantization_fallbacks"]
    assert fallbacks["tensors"] > 0
    # written straight from the source (tensor_quant.py): the types libllama chose for rows of 64, not whole 256-blocks
    assert {(f["from"], f["to"]) for f in fallbacks["fallbacks"]} <= {("a 256-block type", t) for t in ("Q5_0", "Q8_0", "Q5_1")}
    assert sum(f["tensors"] for f in fallbacks["fallbacks"]) > 0


# --- issue 7: what a store may claim, and what a destination may hold -------------------------------


def _copy_store(env, tmp_path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(env["store"], store)
    return store


def _rewrite_manifest(store: Path, build, edit) -> Path:
    """Replace a build's manifest by edit(its JSON) and re-point its ref's sha256, so only the content is wrong."""
    mpath = store / f"manifests/{SLUG}/{build.recipe}/{build.build_id}.json"
    raw = edit(json.loads(mpath.read_text()))
    raw = raw if isinstance(raw, bytes) else json.dumps(raw, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    mpath.write_bytes(raw)
    ref = store / f"refs/{SLUG}/{build.recipe}/latest"
    doc = json.loads(ref.read_text())
    ref.write_text(json.dumps({**doc, "manifest_sha256": hashlib.sha256(raw).hexdigest()}))
    return mpath


def test_manifest_of_another_model_is_refused(env, tmp_path):
    """Item 1: a manifest under the requested model's path that describes another model is never served."""
    store = _copy_store(env, tmp_path)
    f16 = env["builds"]["gguf-f16"]
    _rewrite_manifest(store, f16, lambda doc: {**doc, "model": {**doc["model"], "id": "test-org/other"}})
    dest = tmp_path / "model"
    for spec in (MODEL, f"{MODEL}@{f16.build_id}"):  # by ref and by build id
        with pytest.raises(IntegrityError, match=f"manifest manifests/{SLUG}/gguf-f16/{f16.build_id}.json is for "
                                                 f"model 'test-org/other', not '{MODEL}'") as ei:
            pull(spec, CPU, dest, recipe="gguf-f16", store_uri=str(store))
        assert "\n" not in str(ei.value)
    assert not dest.exists()


def _ref(text: str):
    def damage(store: Path, build) -> str:
        key = f"refs/{SLUG}/{build.recipe}/latest"
        (store / key).write_text(text)
        return key
    return damage


def _manifest(edit):
    def damage(store: Path, build) -> str:
        return str(_rewrite_manifest(store, build, edit).relative_to(store))
    return damage


@pytest.mark.parametrize("damage, by_build_id, message", [
    (_ref("{not json"), False, "{key} is not (valid )?JSON"),
    (_ref("{}"), False, "ref {key} has no valid build_id"),
    (_ref("[1, 2]"), False, "ref {key} has no valid build_id"),
    (_ref('{"build_id": 7}'), False, "ref {key} has no valid build_id"),
    (_ref('{"build_id": "../../x"}'), False, "ref {key} has no valid build_id"),
    (_manifest(lambda doc: b"{not json"), False, r"{key} is not a valid manifest \(.*Invalid JSON"),
    (_manifest(lambda doc: {k: v for k, v in doc.items() if k != "files"}), False,
     r"{key} is not a valid manifest \(files: Field required\)"),
    (_manifest(lambda doc: {**doc, "files": [{"path": "x"}]}), True,
     r"{key} is not a valid manifest \(files.0.sha256: Field required\)"),
], ids=["ref-not-json", "ref-empty", "ref-list", "ref-build-id-int", "ref-build-id-path", "manifest-not-json",
        "manifest-no-files", "manifest-bad-file-by-build-id"])
def test_unusable_ref_or_manifest_is_a_one_line_store_error(env, tmp_path, damage, by_build_id, message):
    """Item 9: no JSONDecodeError, KeyError, TypeError or pydantic ValidationError escapes; the key is named."""
    store = _copy_store(env, tmp_path)
    f16 = env["builds"]["gguf-f16"]
    key = damage(store, f16)
    spec = f"{MODEL}@{f16.build_id}" if by_build_id else MODEL
    with pytest.raises(StoreError) as ei:
        pull(spec, CPU, tmp_path / "model", recipe="gguf-f16", store_uri=str(store))
    assert str(ei.value).startswith(f"{store.as_uri()}: ") and re.search(message.format(key=key), str(ei.value))
    assert "\n" not in str(ei.value)
    assert not (tmp_path / "model").exists()


def test_file_corrupted_at_the_same_size_is_pulled_again(env, tmp_path, monkeypatch):
    """Item 5: equal sizes prove nothing; a file rewritten in place is re-hashed, found wrong and pulled again."""
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))
    dest = tmp_path / "srv" / "model"
    res = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    f = env["builds"]["gguf-f16"].files[0]
    gguf = Path(res.files[0])
    before = gguf.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity: the write below must move the mtime
    with open(gguf, "r+b") as fh:
        fh.seek(f["size"] // 2)
        byte = fh.read(1)
        fh.seek(f["size"] // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert gguf.stat().st_size == before.st_size and gguf.stat().st_mtime_ns != before.st_mtime_ns
    again = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    assert again.already_present is False
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == f["sha256"]
    assert _siblings(dest) == ["model"]


def test_present_check_trusts_its_stamp_and_rehashes_anything_else(env, tmp_path, monkeypatch):
    """Item 5 policy: a file matching the (device, inode, size, mtime, ctime) stamp recorded at pull time is not
    read; a copied DIR (new inodes) is re-hashed once, found intact, reported present, and stamped again."""
    import pipelines.client.pulled_dir as pulled_dir

    dest = tmp_path / "model"
    res = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    name = Path(res.files[0]).name
    st = (dest / name).stat()
    assert json.loads((dest / MARKER).read_text())["stamps"] == {name: identity(st)}

    copy = tmp_path / "copy"
    shutil.copytree(dest, copy)  # new inodes, same bytes
    hashed = _count_hashes(monkeypatch, pulled_dir)
    assert pull(MODEL, CPU, copy, recipe="gguf-f16", store_uri=str(env["store"])).already_present is True
    assert len(hashed) == 1
    st = (copy / name).stat()
    assert json.loads((copy / MARKER).read_text())["stamps"] == {name: identity(st)}

    hashed.clear()
    for d in (dest, copy):
        assert pull(MODEL, CPU, d, recipe="gguf-f16", store_uri=str(env["store"])).already_present is True
    assert hashed == []  # the stamps matched: nothing was read
    monkeypatch.setenv("HIVE_AOT_CACHE_VERIFY", "rehash")  # a cache nobody vouches for: every file, every pull
    assert pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"])).already_present is True
    assert len(hashed) == 1


def _count_hashes(monkeypatch, module) -> list[int]:
    """Every sha256 the module reads from a file (one entry per call)."""
    calls: list[int] = []
    real = module.sha256_stream
    monkeypatch.setattr(module, "sha256_stream", lambda f, *a: calls.append(1) or real(f, *a))
    return calls


def test_timestamps_restored_after_an_edit_prove_nothing(env, tmp_path, monkeypatch):
    """Issue 39 item 1: `cp --preserve=timestamps` over a pulled file writes the cache blob's own inode (DIR files
    are its hard links) and sets the mtime back. The re-pull of that DIR and a pull into a new DIR both notice
    (ctime moved), re-hash, and deliver the published bytes again."""
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))
    f = env["builds"]["gguf-f16"].files[0]
    dest = tmp_path / "srv" / "model"
    gguf = Path(pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"])).files[0])
    forged = tmp_path / "forged.gguf"
    data = bytearray(gguf.read_bytes())
    data[len(data) // 2] ^= 0xFF
    forged.write_bytes(bytes(data))
    before = gguf.stat()
    os.utime(forged, ns=(before.st_atime_ns, before.st_mtime_ns))
    subprocess.run(["cp", "--preserve=timestamps", str(forged), str(gguf)], check=True)
    after = gguf.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() != f["sha256"]  # the blob itself is poisoned now

    other = pull(MODEL, CPU, tmp_path / "srv" / "other", recipe="gguf-f16", store_uri=str(env["store"]))
    assert other.transfer.fetched_bytes == f["size"]  # re-hashed, found wrong, fetched again
    assert hashlib.sha256(Path(other.files[0]).read_bytes()).hexdigest() == f["sha256"]
    again = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    assert again.already_present is False
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == f["sha256"]


def test_replacing_an_earlier_pull_never_deletes_user_files(env, tmp_path):
    """Item 6: a DIR made by an earlier pull is replaced only when it holds nothing but what that pull created."""
    dest = tmp_path / "model"
    q4 = pull(MODEL, CPU, dest, store_uri=str(env["store"]))
    (dest / "notes.txt").write_text("mine")
    (dest / "extra").mkdir()
    (dest / "extra" / "lora.bin").write_bytes(b"mine too")
    with pytest.raises(HiveError, match=r"holds files an earlier pull did not create \(extra, notes.txt\): "
                                        r"refusing to replace it") as ei:
        pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    assert "\n" not in str(ei.value)
    assert sorted(p.name for p in dest.iterdir()) == sorted(["extra", "notes.txt", MARKER, KEPT, "tiny-llama-Q4_K_M.gguf"])
    assert (dest / "notes.txt").read_text() == "mine" and (dest / "extra" / "lora.bin").read_bytes() == b"mine too"
    assert json.loads((dest / MARKER).read_text())["build_id"] == q4.build_id
    assert _siblings(dest) == ["model"]
    # the same build is still "present" (nothing to replace, nothing deleted)
    assert pull(MODEL, CPU, dest, store_uri=str(env["store"])).already_present is True
    assert (dest / "notes.txt").is_file()
    # once the user's files are gone the switch goes through
    (dest / "notes.txt").unlink()
    shutil.rmtree(dest / "extra")
    assert pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"])).recipe == "gguf-f16"
    assert sorted(p.name for p in dest.iterdir()) == sorted(["tiny-llama-F16.gguf", MARKER, KEPT])


@pytest.mark.parametrize("recipes", [["gguf-q4_k_m"] * 6, ["gguf-f16", "gguf-q4_k_m"] * 3], ids=["same", "mixed"])
def test_concurrent_pulls_into_one_dest(env, tmp_path, recipes):
    """Item 7: N processes pulling into one DIR all succeed; DIR ends complete, with no temporaries beside it."""
    dest, go = tmp_path / "srv" / "model", tmp_path / "go"
    procs = []
    for i, recipe in enumerate(recipes):
        code = (
            "import json, os, time\n"
            "from pathlib import Path\n"
            "from pipelines.client.pull import pull\n"
            f"Path({str(tmp_path / f'ready-{i}')!r}).touch()\n"
            f"while not os.path.exists({str(go)!r}):\n"
            "    time.sleep(0.002)\n"
            f"res = pull({MODEL!r}, {CPU!r}, Path({str(dest)!r}), recipe={recipe!r}, store_uri={str(env['store'])!r})\n"
            "print(json.dumps(res.to_json()))\n"
        )
        env_vars = {k: v for k, v in os.environ.items() if k != "HIVE_AOT_REGISTRY"}
        env_vars.update(PYTHONPATH=str(REPO), HIVE_AOT_CACHE=str(tmp_path / "cache"))  # one cache, shared too
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env_vars,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{i}").exists() for i in range(len(recipes))) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # all start pulling at once
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), [err for _, err in outs]
    results = [json.loads(out) for out, _ in outs]
    builds = {r: env["builds"][r].build_id for r in set(recipes)}
    assert all(res["build_id"] == builds[recipe] for res, recipe in zip(results, recipes))
    marker = json.loads((dest / MARKER).read_text())
    assert marker["build_id"] in builds.values()
    files = marker["manifest"]["files"]
    assert sorted(p.name for p in dest.iterdir()) == sorted([f["path"] for f in files] + [MARKER, KEPT])
    assert all(hashlib.sha256((dest / f["path"]).read_bytes()).hexdigest() == f["sha256"] for f in files)
    assert _siblings(dest) == ["model"]  # no partial DIR, no .old DIR, and the lock file is gone too
    if len(builds) == 1:
        assert sorted(res["already_present"] for res in results) == [False] + [True] * (len(recipes) - 1)


@pytest.mark.parametrize("where", ["proc", "below-a-file", "two-below-a-file", "root"])
def test_unwritable_dest_is_a_one_line_error(env, tmp_path, capsys, where):
    """Item 9: a DIR that cannot be created is a one-line HiveError, not an OSError traceback (tests run as root,
    so a chmod'ed directory stops nothing: /proc and a regular file on the way stand in for it)."""
    from pipelines.cli.main import main

    (tmp_path / "file").write_text("a regular file")
    dest = {"proc": Path("/proc/self/model"), "below-a-file": tmp_path / "file" / "model",
            "two-below-a-file": tmp_path / "file" / "sub" / "model", "root": Path("/")}[where]
    with pytest.raises(HiveError, match="cannot pull into ") as ei:
        pull(MODEL, CPU, dest, store_uri=str(env["store"]))
    assert "\n" not in str(ei.value) and not isinstance(ei.value, OSError)
    assert (tmp_path / "file").read_text() == "a regular file"
    capsys.readouterr()
    assert main(["pull", MODEL, "--target", CPU, "--dest", str(dest), "--store", str(env["store"])]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hive-aot: error: cannot pull into ") and err.count("\n") == 1, err


def test_a_pull_of_another_build_waits_for_the_one_in_progress(env, tmp_path, monkeypatch):
    """Item 7, deterministically: while one pull of DIR is mid-way (held inside its blob fetch), a pull of another
    build into DIR does not finish; released, both succeed in order and DIR holds the later build, complete."""
    import threading

    import pipelines.client.pull as pull_mod

    dest = tmp_path / "model"
    f16_digest = env["builds"]["gguf-f16"].files[0]["sha256"]
    entered, release = threading.Event(), threading.Event()
    real = pull_mod.fetch_blobs

    def paused_fetch(store, sizes, *a, **kw):
        if f16_digest in sizes:
            entered.set()
            release.wait(60)
        return real(store, sizes, *a, **kw)

    monkeypatch.setattr(pull_mod, "fetch_blobs", paused_fetch)
    results: dict[str, object] = {}

    def run(recipe: str) -> None:
        try:
            results[recipe] = pull(MODEL, CPU, dest, recipe=recipe, store_uri=str(env["store"]))
        except BaseException as e:  # noqa: BLE001 - reported by the asserts below
            results[recipe] = e

    first = threading.Thread(target=run, args=("gguf-f16",))
    first.start()
    assert entered.wait(60)
    second = threading.Thread(target=run, args=("gguf-q4_k_m",))
    second.start()
    second.join(1.0)
    assert second.is_alive() and "gguf-q4_k_m" not in results  # it waits for the pull in progress
    release.set()
    first.join(60)
    second.join(60)
    assert results["gguf-f16"].build_id == env["builds"]["gguf-f16"].build_id, results
    assert results["gguf-q4_k_m"].build_id == env["builds"]["gguf-q4_k_m"].build_id, results
    assert json.loads((dest / MARKER).read_text())["recipe"] == "gguf-q4_k_m"
    assert sorted(p.name for p in dest.iterdir()) == sorted(["tiny-llama-Q4_K_M.gguf", MARKER, KEPT])
    assert _siblings(dest) == ["model"]


def test_partials_of_killed_pulls_are_reclaimed_live_ones_kept(env, tmp_path, monkeypatch):
    """A pull killed mid-download leaves `.<digest>.<random>.partial`; the next pull removes it, unless the
    pull that owns it is alive (it holds a lock on it)."""
    from pipelines.client.pull import reclaim_partials

    cache = tmp_path / "cache"
    monkeypatch.setenv("HIVE_AOT_CACHE", str(cache))
    d = cache / "blobs" / "sha256" / "ab"
    d.mkdir(parents=True)
    dead, live = d / ".abcdef012345.x1.partial", d / ".abcdef012345.x2.partial"
    dead.write_bytes(b"x" * 1000)
    live.write_bytes(b"y" * 1000)
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(live)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        pull(MODEL, CPU, tmp_path / "m", recipe="gguf-f16", store_uri=str(env["store"]))
        assert not dead.exists() and live.exists()
        holder.kill()
        holder.wait(timeout=30)
        assert reclaim_partials() == [live.name] and not live.exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_target_auto_names_what_it_found_and_why_it_chose(env, tmp_path, capsys):
    """On this host (no accelerator) auto is the CPU tier, and pull says so in JSON and in its human output."""
    from pipelines.cli.main import main

    res = pull(MODEL, "auto", tmp_path / "m", store_uri=str(env["store"]), registry=str(env["registry"]))
    assert res.runtime_profile == CPU and res.recipe == "gguf-q4_k_m"
    assert res.auto_target.detected == "cpu" and res.auto_target.profile == CPU
    assert "CPU's gguf profile" in res.auto_target.why
    capsys.readouterr()
    assert main(["pull", MODEL, "--target", "auto", "--dest", str(tmp_path / "m2"), "--store", str(env["store"]),
                 "--registry", str(env["registry"])]) == 0
    out = capsys.readouterr().out
    assert "target auto: found no accelerator" in out and f"chose {CPU}" in out


def test_profiles_lists_what_is_published_per_profile(env, capsys):
    from pipelines.cli.main import main

    capsys.readouterr()
    assert main(["profiles", MODEL, "--store", str(env["store"]), "--registry", str(env["registry"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["profile"]: r for r in doc["profiles"]}
    assert list(rows) == [CPU]  # only GGUF recipes were published
    assert sorted(a["recipe"] for a in rows[CPU]["artifacts"]) == ["gguf-f16", "gguf-q4_k_m"]
    assert rows[CPU]["pull_picks"] == "gguf-q4_k_m" and doc["auto"]["profile"] == CPU
    assert main(["profiles", "test-org/nothing-here", "--store", str(env["store"])]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hive-aot: error: test-org/nothing-here: nothing published") and err.count("\n") == 1


def test_engine_versions_validated_with_are_compared(env, tmp_path, monkeypatch, capsys):
    """The manifest records the engine a GGUF was validated in (llama-cpp-python here); a container with another
    version gets a warning, or with --strict a one-line refusal and nothing pulled."""
    from importlib import metadata

    from pipelines.cli.main import main

    here = metadata.version("llama_cpp_python")
    res = pull(MODEL, CPU, tmp_path / "same", store_uri=str(env["store"]))
    assert res.engines == [{"engine": "llama_cpp_python", "validated_with": here, "here": here, "status": "same"}]
    assert res.warnings == []
    monkeypatch.setenv("HIVE_AOT_ENGINE_VERSIONS", "llama_cpp_python=0.2.90")
    capsys.readouterr()
    assert main(["pull", MODEL, "--target", CPU, "--dest", str(tmp_path / "older"), "--store", str(env["store"])]) == 0
    err = capsys.readouterr().err
    assert f"hive-aot: warning: {MODEL} gguf-q4_k_m was validated with llama_cpp_python {here}, this container has 0.2.90" in err
    assert main(["pull", MODEL, "--target", CPU, "--dest", str(tmp_path / "strict"), "--store", str(env["store"]),
                 "--strict"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(--strict): nothing was pulled" in err and not (tmp_path / "strict").exists()


def test_every_built_in_kind_loads_in_the_light_client():
    """pull asks each published kind for its artifact format (kinds.target_class): importing a target must not
    load the build extra's modules, which a serving container does not have (a VLM family module importing
    numpy at the top broke `hive-aot pull` in the base install). Checked in a child that refuses them."""
    from pipelines.config.kinds import BUILTIN

    probe = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('numpy', 'torch', 'transformers', 'safetensors', 'onnx', 'dagster'):\n"
        "            raise ImportError(f'the light client has no {name}')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from pipelines.config.kinds import BUILTIN, target_class\n"
        "for kind in BUILTIN:\n"
        "    target_class(kind)\n"
        "print(sorted(BUILTIN))\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == repr(sorted(BUILTIN))


@pytest.mark.parametrize("reserved", ["hive-aot.json", "hive-aot.manifest.json", "model.sig"])
def test_a_manifest_listing_a_name_pull_keeps_for_itself_is_refused(env, tmp_path, reserved):
    """The marker, the manifest's copy and the signature file are hive-aot's in a pulled DIR: a rewritten manifest
    that lists a file under one of those names (to shadow the signature a verifier reads) is one line, nothing
    in DIR."""
    store = tmp_path / "store"
    shutil.copytree(env["store"], store)

    def rename(doc):
        doc["files"][0]["path"] = reserved

    rewrite_published_manifest(store, "gguf-f16", rename)
    with pytest.raises(IntegrityError, match=f"lists '{reserved}', a name hive-aot keeps for itself"):
        pull(MODEL, CPU, tmp_path / "d", recipe="gguf-f16", store_uri=str(store), registry=str(env["registry"]))
    assert not (tmp_path / "d").exists()
