"""Pull: ref -> manifest -> verified blobs -> DIR, as a serving container runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from factories import write_test_config
from pipelines.build import build_and_publish
from pipelines.config import Config
from pipelines.errors import HiveError, IntegrityError
from pipelines.pull import MARKER, pull

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


def _siblings(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir()) if dest.parent.exists() else []


def test_profile_preference_picks_q4_k_m(env, tmp_path):
    dest = tmp_path / "model"
    res = pull(MODEL, CPU, dest, store_uri=str(env["store"]), registry=str(env["registry"]))
    q4 = env["builds"]["gguf-q4_k_m"]
    assert res["recipe"] == "gguf-q4_k_m" and res["build_id"] == q4.build_id
    assert res["already_present"] is False and res["runtime_profile"] == CPU
    assert res["files"] == [str(dest / "tiny-llama-Q4_K_M.gguf")]
    assert res["serve"].startswith(f"llama-server -m {dest / 'tiny-llama-Q4_K_M.gguf'} -c ")


def test_recipe_flag_and_build_id(env, tmp_path):
    f16 = env["builds"]["gguf-f16"]
    res = pull(MODEL, CPU, tmp_path / "a", recipe="gguf-f16", store_uri=str(env["store"]))
    assert res["recipe"] == "gguf-f16" and res["build_id"] == f16.build_id
    res = pull(f"{MODEL}@{f16.build_id}", CPU, tmp_path / "b", store_uri=str(env["store"]))
    assert res["recipe"] == "gguf-f16" and res["build_id"] == f16.build_id
    q4 = env["builds"]["gguf-q4_k_m"]
    res = pull(f"{MODEL}@{q4.build_id}", CPU, tmp_path / "c", store_uri=str(env["store"]))
    assert res["recipe"] == "gguf-q4_k_m"
    with pytest.raises(HiveError, match=f"{MODEL}: nothing published with build {'0' * 64}"):
        pull(f"{MODEL}@{'0' * 64}", CPU, tmp_path / "d", store_uri=str(env["store"]))
    # the revision tag works too
    rev = json.loads((env["store"] / f"manifests/{SLUG}/gguf-f16/{f16.build_id}.json").read_text())["model"]["revision"]
    res = pull(MODEL, CPU, tmp_path / "e", tag=rev, recipe="gguf-f16", store_uri=str(env["store"]))
    assert res["build_id"] == f16.build_id
    assert not (tmp_path / "d").exists()


def test_dest_holds_manifest_files_and_marker(env, tmp_path):
    dest = tmp_path / "srv" / "model"
    pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]), registry=str(env["registry"]))
    f16 = env["builds"]["gguf-f16"]
    assert sorted(p.name for p in dest.iterdir()) == sorted([f16.files[0]["path"], MARKER])
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
    gguf = Path(first["files"][0])
    stamp = (gguf.stat().st_ino, gguf.stat().st_mtime_ns, (dest / MARKER).stat().st_mtime_ns)
    again = pull(MODEL, CPU, dest, store_uri=str(env["store"]))
    assert again["already_present"] is True and again["build_id"] == first["build_id"]
    assert (gguf.stat().st_ino, gguf.stat().st_mtime_ns, (dest / MARKER).stat().st_mtime_ns) == stamp

    other = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    assert other["already_present"] is False and other["recipe"] == "gguf-f16"
    assert sorted(p.name for p in dest.iterdir()) == sorted(["tiny-llama-F16.gguf", MARKER])
    assert _siblings(dest) == ["model"]

    # a DIR whose files were damaged is not "already present": it is pulled again
    (dest / "tiny-llama-F16.gguf").unlink()
    fixed = pull(MODEL, CPU, dest, recipe="gguf-f16", store_uri=str(env["store"]))
    assert fixed["already_present"] is False and (dest / "tiny-llama-F16.gguf").is_file()


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
    assert pull(MODEL, CPU, empty, store_uri=str(env["store"]))["recipe"] == "gguf-q4_k_m"


def test_bad_requests(env, tmp_path):
    store = str(env["store"])
    with pytest.raises(HiveError, match="unknown runtime profile 'tpu-v5'"):
        pull(MODEL, "tpu-v5", tmp_path / "m", store_uri=store)
    with pytest.raises(HiveError, match=r"no published artifact serves vllm-cu121 \(published: gguf-f16"):
        pull(MODEL, "vllm-cu121", tmp_path / "m", store_uri=store)
    with pytest.raises(HiveError, match="no published gguf-q8_0 artifact serves llm-llamacpp-cpu"):
        pull(MODEL, CPU, tmp_path / "m", recipe="gguf-q8_0", store_uri=store)
    with pytest.raises(HiveError, match="'tiny-llama' is not org/name"):
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

    from pipelines import prompts

    res = pull(MODEL, CPU, tmp_path / "model", recipe="gguf-f16", store_uri=str(env["store"]))
    marker = json.loads((tmp_path / "model" / MARKER).read_text())
    expected = marker["manifest"]["validation"]["generation"]["artifact"]
    llm = Llama(model_path=res["files"][0], n_ctx=64, n_batch=64, verbose=False, seed=0, n_threads=os.cpu_count() or 1)
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
    finally:
        llm.close()
    assert len(gen) > 0
    text = llm.detokenize(gen).decode("utf-8", errors="replace")
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
        "from pipelines.pull import pull\n"
        f"res = pull({MODEL!r}, {CPU!r}, Path('dest'), store_uri={str(env['store'])!r})\n"
        "print(json.dumps(res))\n"
    )
    assert not (tmp_path / "registry.yaml").exists()
    proc = _run_python(code, tmp_path, {"HIVE_AOT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    # the preference (q4_k_m first) can only have come from the store's profiles.json
    assert res["recipe"] == "gguf-q4_k_m" and res["dest"] == str(tmp_path / "dest")
    marker = json.loads((tmp_path / "dest" / MARKER).read_text())
    assert marker["runtime_profile"]["recipe_preference"] == ["gguf-q4_k_m", "gguf-q8_0", "gguf-f16"]


def test_pull_path_imports_neither_dagster_nor_torch(env, tmp_path):
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pipelines.pull import pull\n"
        "from pipelines.cli import main\n"
        f"res = pull({MODEL!r}, {CPU!r}, Path('dest'), store_uri={str(env['store'])!r})\n"
        "assert res['recipe'] == 'gguf-q4_k_m', res\n"
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
    assert {p.name: mode(p) for p in dest.iterdir()} == {Path(res["files"][0]).name: 0o644, MARKER: 0o644}
    # the cache's blob is shared by both pulls (one inode) and keeps the served mode
    f = Path(res["files"][0])
    blob = next((cache / "blobs").rglob(env["builds"]["gguf-f16"].files[0]["sha256"]))
    assert f.stat().st_ino == blob.stat().st_ino == Path(second["files"][0]).stat().st_ino
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
    assert stat.S_IMODE(Path(first["files"][0]).stat().st_mode) == 0o600  # same inode: the old state
    again = pull(MODEL, CPU, tmp_path / "a", recipe="gguf-f16", store_uri=str(env["store"]))
    assert again["already_present"] is False  # an unreadable directory is not "complete"
    assert stat.S_IMODE(Path(again["files"][0]).stat().st_mode) == 0o644


def test_manifest_records_quantization_fallbacks(env):
    q4 = env["builds"]["gguf-q4_k_m"]
    manifest = json.loads((env["store"] / f"manifests/{SLUG}/gguf-q4_k_m/{q4.build_id}.json").read_text())
    fallbacks = manifest["build"]["quantization_fallbacks"]
    assert fallbacks["tensors"] > 0
    assert {(f["from"], f["to"]) for f in fallbacks["fallbacks"]} <= {("q4_K", "q5_0"), ("q6_K", "q8_0"), ("q5_K", "q5_1")}
    assert sum(f["tensors"] for f in fallbacks["fallbacks"]) > 0
