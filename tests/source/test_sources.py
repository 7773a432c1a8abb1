"""pipelines.source.fetch: fetching HF repos through a real mirror (olah on loopback) and local directories.

No mocks: the real huggingface_hub client talks to the `hf_mirror` fixture, which serves git repos
published by the tests. Bad input must fail with one clear line (a HiveError) and leave nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from factories import copy_model

from pipelines.core.errors import HiveError, ModelFormatError, SourceError
from pipelines.core.paths import model_slug, safe_relpath
from pipelines.source.fetch import MARKER, WANTED_PATTERNS, fetch, parse_source, select_files

ORG = "sources-test"  # a namespace of our own: other test modules share the session mirror
REPO_ROOT = Path.cwd()
HIVE_AOT = str(Path(sys.executable).parent / "hive-aot")


# --- helpers -----------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Touch:
    """Unpickling this object creates `path` (via pathlib, no os.system): a live pickle payload."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def write_evil_pickle(dest: Path, sentinel: Path) -> None:
    dest.write_bytes(pickle.dumps({"model.embed_tokens.weight": _Touch(sentinel)}))


def one_line_error(exc: BaseException) -> str:
    msg = str(exc)
    assert isinstance(exc, HiveError), f"{type(exc).__name__} is not a HiveError: {msg}"
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    return msg


def snapshots_of(repo_id: str) -> list[Path]:
    """Everything the fetcher left in the cache for repo_id (complete or not)."""
    root = Path(os.environ["HIVE_AOT_CACHE"]) / "snapshots" / model_slug(repo_id)
    return sorted(root.iterdir()) if root.is_dir() else []


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([HIVE_AOT, *args], cwd=REPO_ROOT, env=env if env is not None else dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


# --- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_src(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama plus what a real repo carries that builds must not download."""
    src = copy_model(tiny_llama, tmp_path_factory.mktemp("sources") / "tiny")
    (src / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n# tiny\nA test model.\n")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really torch weights")
    (src / "original").mkdir()
    (src / "original" / "x.safetensors").write_bytes(b"consolidated weights that builds never read")
    return src


@pytest.fixture(scope="module")
def tiny_repo(hf_mirror, tiny_src) -> tuple[str, str, Path]:
    repo = f"{ORG}/tiny"
    commit = hf_mirror.publish(repo, tiny_src)
    return repo, commit, tiny_src


# --- HF sources through the mirror ------------------------------------------------------------------


def test_fetch_pins_commit_and_downloads_only_what_builds_need(tiny_repo):
    repo, commit, src = tiny_repo
    snap = fetch(f"hf://{repo}@main")
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    assert snap.commit == commit
    assert snap.model_id == repo and snap.revision == "main"
    assert snap.pinned_source == f"hf://{repo}@{commit}"

    expected = {"README.md", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                "tokenizer.json", "tokenizer_config.json"}
    assert {f.path for f in snap.files} == expected
    on_disk = {str(p.relative_to(snap.dir)) for p in snap.dir.rglob("*") if p.is_file()} - {MARKER}
    assert on_disk == expected, "only the wanted files may land in the snapshot"
    assert not (snap.dir / "pytorch_model.bin").exists() and not (snap.dir / "original").exists()
    assert not (snap.dir / ".cache").exists()

    for f in snap.files:
        assert f.sha256 == sha256(src / f.path), f.path
        assert f.size == (src / f.path).stat().st_size, f.path
        assert sha256(snap.dir / f.path) == f.sha256
    # olah parses the README front matter into card data; the license must come through.
    assert snap.license == "apache-2.0"
    assert snap.gated is False


def test_second_fetch_reuses_the_cached_snapshot(tiny_repo):
    repo, commit, _ = tiny_repo
    first = fetch(f"hf://{repo}@main")
    marker = first.dir / MARKER
    weights = first.dir / "model.safetensors"
    before = (marker.stat().st_mtime_ns, marker.stat().st_ino, weights.stat().st_mtime_ns, weights.stat().st_ino)

    again = fetch(f"hf://{repo}@{commit}")
    assert (again.dir, again.commit, again.files, again.license) == (first.dir, first.commit, first.files, first.license)
    # Served from the cache, but described as what was asked for this time.
    assert again.revision == commit and again.source == f"hf://{repo}@{commit}"
    after = (marker.stat().st_mtime_ns, marker.stat().st_ino, weights.stat().st_mtime_ns, weights.stat().st_ino)
    assert after == before, "the snapshot was downloaded again"
    assert snapshots_of(repo) == [first.dir], "no temporary download directories may be left behind"


def test_owner_repo_without_scheme(tiny_repo):
    repo, commit, _ = tiny_repo
    spec = parse_source(repo)
    assert (spec.kind, spec.repo_id, spec.revision) == ("hf", repo, None)
    snap = fetch(repo)
    assert snap.commit == commit and snap.source == f"hf://{repo}" and snap.revision == "main"
    assert fetch(f"{repo}@main").commit == commit


def test_new_upstream_commit_gives_a_new_snapshot(hf_mirror, tiny_llama, tmp_path):
    repo = f"{ORG}/evolving"
    src = copy_model(tiny_llama, tmp_path / "m")
    first_commit = hf_mirror.publish(repo, src)
    first = fetch(f"hf://{repo}@main")
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (src / "config.json").write_text(json.dumps(cfg))
    second_commit = hf_mirror.publish(repo, src)
    assert second_commit != first_commit
    second = fetch(f"hf://{repo}@main")
    assert second.commit == second_commit and second.dir != first.dir
    assert json.loads((second.dir / "config.json").read_text())["rms_norm_eps"] == 1e-6
    # The old commit is still fetchable by sha, from the cache and unchanged.
    old = fetch(f"hf://{repo}@{first_commit}")
    assert old.commit == first_commit and old.files == first.files


def test_a_pinned_commit_already_here_asks_the_hub_nothing(hf_mirror, tiny_llama, tmp_path, monkeypatch):
    """A commit never changes: once its snapshot is complete in the cache, fetching it again (a no-op onboarding
    of a pinned model) makes no Hub call; a branch still asks the Hub where it points now."""
    import pipelines.source.fetch as sources

    repo = f"{ORG}/pinned"
    commit = hf_mirror.publish(repo, copy_model(tiny_llama, tmp_path / "m"))
    first = fetch(f"hf://{repo}@{commit}")
    asked = []

    def hub_call(*args, **kwargs):
        asked.append(args[1].revision)
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(sources, "fetch_hf_info", hub_call)
    again = fetch(f"hf://{repo}@{commit}")
    assert again.commit == commit and again.files == first.files and again.dir == first.dir and asked == []
    with pytest.raises(AssertionError):
        fetch(f"hf://{repo}@main")
    assert asked == ["main"]


def test_unknown_repo_is_one_line_source_error(hf_mirror):
    with pytest.raises(SourceError) as ei:
        fetch(f"hf://{ORG}/does-not-exist@main")
    msg = one_line_error(ei.value)
    assert f"{ORG}/does-not-exist" in msg and "not found" in msg
    assert snapshots_of(f"{ORG}/does-not-exist") == []


def test_unknown_revision_is_one_line_source_error(tiny_repo):
    repo, _, _ = tiny_repo
    with pytest.raises(SourceError) as ei:
        fetch(f"hf://{repo}@no-such-branch")
    # olah answers 401 for an unknown revision too, so the client cannot tell it from an unknown repo.
    assert repo in one_line_error(ei.value)


def test_unreachable_hub_is_one_line_error():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    secret = f"hf_{uuid.uuid4().hex}"
    res = cli("check", f"hf://{ORG}/anything@main", env={**os.environ, "HF_ENDPOINT": dead, "HF_TOKEN": secret})
    assert res.returncode == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot reach the Hub" in lines[0] and dead in lines[0], res.stderr[-2000:]
    assert secret not in res.stdout + res.stderr


def test_pickle_only_repo_is_refused_without_unpickling(hf_mirror, tiny_llama, tmp_path):
    sentinel = tmp_path / "unpickled-sentinel"
    # The payload is live: unpickling a twin creates its own sentinel.
    probe = tmp_path / "probe"
    write_evil_pickle(tmp_path / "twin.bin", probe)
    pickle.loads((tmp_path / "twin.bin").read_bytes())
    assert probe.exists()

    src = tmp_path / "pickled"
    src.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, src / name)
    write_evil_pickle(src / "pytorch_model.bin", sentinel)
    repo = f"{ORG}/pickled"
    hf_mirror.publish(repo, src)

    with pytest.raises(SourceError) as ei:
        fetch(f"hf://{repo}@main")
    msg = one_line_error(ei.value)
    assert "pickle" in msg and "pytorch_model.bin" in msg
    assert not sentinel.exists(), "a pickle was unpickled"
    assert snapshots_of(repo) == []

    # The same directory as a local source is refused the same way.
    with pytest.raises(SourceError, match="pickle"):
        fetch(str(src))
    assert not sentinel.exists()


def test_hf_index_naming_outside_shard_is_refused_and_nothing_kept(hf_mirror, tiny_llama, tmp_path):
    src = copy_model(tiny_llama, tmp_path / "m")
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../outside.safetensors"}}))
    repo = f"{ORG}/escaping-index"
    hf_mirror.publish(repo, src)
    with pytest.raises(SourceError) as ei:
        fetch(f"hf://{repo}@main")
    assert "../outside.safetensors" in one_line_error(ei.value)
    leftovers = [p for d in snapshots_of(repo) for p in d.rglob("*")] + snapshots_of(repo)
    assert leftovers == [], f"a refused download left {leftovers}"


# --- file names from untrusted sources -------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "../model.safetensors", "a/../../model.safetensors", "/etc/model.safetensors", "sub\\model.safetensors",
    "..\\..\\model.safetensors", "a/./../model.safetensors", "dir/", "C:model.safetensors",
    "model\x00.safetensors", "",
])
def test_unsafe_names_are_refused(name):
    with pytest.raises(SourceError) as ei:
        safe_relpath(name)
    one_line_error(ei.value)
    with pytest.raises(SourceError):
        select_files(["config.json", "model.safetensors", name], "org/m")


@pytest.mark.parametrize("name", ["model.safetensors", "sub/model-00001-of-00002.safetensors", "a.b/c_d-e.json"])
def test_plain_relative_names_are_accepted(name):
    assert safe_relpath(name) == name


def test_select_files_keeps_only_what_builds_read():
    names = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "pytorch_model.bin", "original/consolidated.safetensors",
             "consolidated.00.safetensors", "flax_model.msgpack", "tf_model.h5", "onnx/model.onnx", "README.md",
             "training_args.bin", "LICENSE"]
    assert select_files(names, "org/m") == sorted([
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "README.md", "LICENSE"])
    assert "config.json" in WANTED_PATTERNS


def test_select_files_refuses_repos_without_safetensors_or_config():
    with pytest.raises(SourceError, match="pickle"):
        select_files(["config.json", "pytorch_model.bin", "model.pt"], "org/m")
    with pytest.raises(SourceError, match="no \\*.safetensors"):
        select_files(["config.json", "tf_model.h5"], "org/m")
    with pytest.raises(ModelFormatError, match="config.json is missing") as ei:
        select_files(["model.safetensors", "tokenizer.json"], "org/m")
    one_line_error(ei.value)


# --- local directory sources -----------------------------------------------------------------------


def test_local_revision_is_content_addressed(tiny_llama, tmp_path):
    src = copy_model(tiny_llama, tmp_path / "m")
    snap = fetch(str(src))
    assert re.fullmatch(r"local-[0-9a-f]{64}", snap.revision)
    assert snap.commit == snap.revision and snap.model_id == "local/m"
    expected = hashlib.sha256(json.dumps(sorted([f.path, sha256(src / f.path)] for f in snap.files),
                                         separators=(",", ":")).encode()).hexdigest()
    assert snap.revision == f"local-{expected}"
    for f in snap.files:
        assert f.sha256 == sha256(src / f.path) and f.size == (src / f.path).stat().st_size

    # Files builds never read do not change the revision; any wanted file does.
    (src / "notes.txt").write_text("scratch")
    assert fetch(str(src)).revision == snap.revision
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (src / "config.json").write_text(json.dumps(cfg))
    changed = fetch(str(src))
    assert changed.revision != snap.revision
    # Same bytes at another path: same revision (the directory name is not part of it).
    twin = copy_model(src, tmp_path / "twin")
    assert fetch(str(twin)).revision == changed.revision


def test_local_symlink_inside_is_accepted(tiny_llama, tmp_path):
    src = copy_model(tiny_llama, tmp_path / "m")
    (src / "blobs").mkdir()
    (src / "model.safetensors").rename(src / "blobs" / "weights")
    (src / "model.safetensors").symlink_to(Path("blobs") / "weights")
    snap = fetch(str(src))
    rec = next(f for f in snap.files if f.path == "model.safetensors")
    assert rec.sha256 == sha256(tiny_llama / "model.safetensors")


def test_local_symlink_outside_is_refused(tiny_llama, tmp_path):
    src = copy_model(tiny_llama, tmp_path / "m")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (src / "config.json").rename(outside / "config.json")
    (src / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(SourceError) as ei:
        fetch(str(src))
    assert "config.json" in one_line_error(ei.value) and "outside" in str(ei.value)


def test_local_index_naming_a_path_outside_is_refused(tiny_llama, tmp_path):
    src = copy_model(tiny_llama, tmp_path / "m")
    shutil.copy(tiny_llama / "model.safetensors", tmp_path / "outside.safetensors")  # tempting, and real
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../outside.safetensors"}}))
    with pytest.raises(SourceError) as ei:
        fetch(str(src))
    assert "../outside.safetensors" in one_line_error(ei.value)


def test_local_index_naming_a_missing_shard_is_refused(tiny_llama, tmp_path):
    src = copy_model(tiny_llama, tmp_path / "m")
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelFormatError) as ei:
        fetch(str(src))
    assert "model-00002-of-00002.safetensors" in one_line_error(ei.value)
    # With the shard present, the same index is accepted.
    shutil.copy(src / "model-00001-of-00002.safetensors", src / "model-00002-of-00002.safetensors")
    assert {f.path for f in fetch(str(src)).files} >= {"model-00002-of-00002.safetensors", "model.safetensors.index.json"}


def test_local_missing_config_is_refused(tiny_llama, tmp_path):
    src = copy_model(tiny_llama, tmp_path / "m")
    (src / "config.json").unlink()
    with pytest.raises(ModelFormatError) as ei:
        fetch(str(src))
    assert "config.json is missing" in one_line_error(ei.value)


def test_malformed_config_fails_plan_and_cli_with_one_line(tiny_llama, tmp_path, config):
    from pipelines.engine.build import plan

    src = copy_model(tiny_llama, tmp_path / "m")
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,')
    with pytest.raises(HiveError) as ei:
        plan(str(src), "gguf-f16", config, model_id=f"{ORG}/malformed")
    assert "config.json is not valid JSON" in one_line_error(ei.value)

    store = tmp_path / "store"
    res = cli("build", str(src), "--model-id", f"{ORG}/malformed", "--recipe", "gguf-f16", "--store", str(store),
              "--json")
    assert res.returncode == 1, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hive-aot: error:") and "config.json" in lines[0], res.stderr
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == 1 and "config.json" in doc["error"]
    assert not (store / "manifests").exists() and not (store / "refs").exists()


# --- the CLI end to end, and secrets --------------------------------------------------------------


def test_hf_token_never_appears_in_cli_output(tiny_repo, tmp_path, monkeypatch):
    repo, commit, _ = tiny_repo
    secret = f"hf_{uuid.uuid4().hex}"
    # A cache of this test's own: the snapshot checked below is written here, under the token, whatever ran before.
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_TOKEN", secret)
    env = {**os.environ, "HIVE_AOT_PROGRESS": "1"}

    missing = cli("check", f"hf://{ORG}/doesnotexist", "--json", env=env)
    assert missing.returncode == 1, missing.stderr
    assert "not found" in json.loads(missing.stdout)["error"]

    ok = cli("check", f"hf://{repo}", "--json", env=env)
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["commit"] == commit and doc["status"] == "compatible"

    for res in (missing, ok):
        assert secret not in res.stdout and secret not in res.stderr
        assert secret[3:] not in res.stdout + res.stderr  # not even without its prefix
    # `check` reads headers only; a fetch with the token writes the snapshot and its marker
    assert snapshots_of(repo) == []
    snap = fetch(f"hf://{repo}@main")
    assert snapshots_of(repo) == [snap.dir] and snap.dir.name == commit
    assert secret not in (snap.dir / MARKER).read_text()


def test_cli_build_through_mirror_then_pull(tiny_repo, tmp_path):
    repo, commit, _ = tiny_repo
    store = tmp_path / "store"
    env = dict(os.environ)
    args = ("build", f"hf://{repo}@main", "--recipe", "gguf-f16", "--store", str(store), "--json")
    first = cli(*args, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    doc = json.loads(first.stdout)
    assert re.fullmatch(r"[0-9a-f]{64}", doc["build_id"])
    assert isinstance(doc["manifest"], str) and doc["build_id"] in doc["manifest"]
    assert doc["skipped"] is False and doc["state"] == "published"
    assert doc["validation"]["passed"] is True
    assert doc["validation"]["metrics"]["top1_agreement"] >= 0.99
    manifest_path = store / "manifests" / model_slug(repo) / "gguf-f16" / f"{doc['build_id']}.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["model"]["commit"] == commit and manifest["model"]["license"] == "apache-2.0"

    second = cli(*args, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    doc2 = json.loads(second.stdout)
    assert doc2["skipped"] is True and doc2["build_id"] == doc["build_id"]

    dest = tmp_path / "out"
    pulled = cli("pull", repo, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", str(store), "--json",
                 env=env)
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    res = json.loads(pulled.stdout)
    assert res["build_id"] == doc["build_id"] and res["recipe"] == "gguf-f16"
    ggufs = sorted(dest.glob("*.gguf"))
    assert len(ggufs) == 1 and ggufs[0].read_bytes()[:4] == b"GGUF"
    (entry,) = [f for f in doc["files"] if f["path"].endswith(".gguf")]
    assert ggufs[0].name == entry["path"] and sha256(ggufs[0]) == entry["sha256"]
    meta = json.loads((dest / "hive-aot.json").read_text())
    assert json.dumps(meta).count(doc["build_id"]) >= 1


def test_local_digest_cache_never_serves_a_stale_digest(tiny_llama, tmp_path):
    """Local sources reuse digests across fetches (each Dagster step re-resolves its snapshot), but a
    rewrite that keeps size and mtime still changes ctime, so the file is hashed again."""
    import os

    d = copy_model(tiny_llama, tmp_path / "m")
    first = fetch(str(d), "sources-test/cache")
    cfg = d / "config.json"
    st = cfg.stat()
    text = cfg.read_text()
    flipped = text.replace('"bos_token_id": 1', '"bos_token_id": 3')
    assert flipped != text and len(flipped) == len(text)
    cfg.write_text(flipped)
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only ctime moved
    second = fetch(str(d), "sources-test/cache")
    digests = {f.path: f.sha256 for f in second.files}
    assert digests["config.json"] == hashlib.sha256(flipped.encode()).hexdigest()
    assert second.revision != first.revision
    third = fetch(str(d), "sources-test/cache")
    assert third.revision == second.revision


# --- the Hugging Face cache layout, and hf:// with the Hub offline ---------------------------------


def hf_cache_snapshot(hub: Path, repo: str, commit: str, src: Path, ref: str = "main") -> Path:
    """`src` laid out as huggingface_hub leaves a download in its cache: blobs named by content hash,
    snapshot files as relative symlinks to them (one more `..` per directory level), refs/<ref> = commit."""
    repo_dir = hub / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = f.relative_to(src)
        blob = repo_dir / "blobs" / sha256(f)
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, blob)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(*[".."] * (len(rel.parts) + 1), "blobs", blob.name))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)  # huggingface_hub writes the bare sha, no newline
    return snap


def build_id_of(snap) -> str:
    """The build id of a snapshot for a fixed recipe and toolchain: what decides whether builds are shared."""
    from pipelines.store.manifest import compute_build_id

    return compute_build_id(snap.model_id, snap.commit, [(f.path, f.sha256) for f in snap.files], "{}", {})


def dead_endpoint() -> str:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """An empty hive-aot cache of this test's own (nothing fetched by other tests can serve it), and a function
    that takes the Hub offline: HF_HUB_OFFLINE on, a dead HF_ENDPOINT (any request fails), HF_HUB_CACHE = hub.
    huggingface_hub read its env at import, so its constants are set as well as the env (for subprocesses)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "hive-cache"))

    def go_offline(hub: Path | None = None) -> Path:
        hub = hub or tmp_path / "empty-hf-cache"
        dead = dead_endpoint()
        for name, value in (("HF_HUB_OFFLINE", True), ("ENDPOINT", dead), ("HF_HUB_CACHE", str(hub))):
            monkeypatch.setattr(constants, name, value)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_ENDPOINT", dead)
        monkeypatch.setenv("HF_HUB_CACHE", str(hub))
        return hub

    return go_offline


@pytest.fixture(scope="module")
def hf_cached(hf_mirror, tiny_src, tmp_path_factory) -> tuple[str, str, Path]:
    """tiny_src published to the mirror and downloaded by huggingface_hub itself into an HF cache."""
    from huggingface_hub import snapshot_download

    repo = f"{ORG}/hf-cached"
    commit = hf_mirror.publish(repo, tiny_src)
    hub = tmp_path_factory.mktemp("hf-hub-cache")
    path = Path(snapshot_download(repo, revision="main", cache_dir=str(hub)))
    assert path == hub / f"models--{ORG}--hf-cached" / "snapshots" / commit
    return repo, commit, hub


def test_hf_cache_model_id_decoding():
    from pipelines.source.fetch import hf_cache_model_id

    assert hf_cache_model_id(Path("models--HuggingFaceTB--SmolLM2-135M")) == "HuggingFaceTB/SmolLM2-135M"
    assert hf_cache_model_id(Path("models--a.b--c_d-e.f")) == "a.b/c_d-e.f"
    assert hf_cache_model_id(Path("models--gpt2")) is None  # legacy id without an org
    assert hf_cache_model_id(Path("models--a--b--c")) is None  # not a repo id huggingface_hub can write


def test_hf_cache_snapshot_is_accepted_and_pinned_like_hf_source(hf_cached):
    """A snapshot huggingface_hub downloaded (symlinks into ../../blobs) fetches as a local source with the
    repo's model id and commit, so its build id is the one hf://repo@commit gives for the same files."""
    repo, commit, hub = hf_cached
    snap_dir = hub / f"models--{ORG}--hf-cached" / "snapshots" / commit
    assert (snap_dir / "config.json").is_symlink() and (snap_dir / "model.safetensors").is_symlink()
    assert (snap_dir / "original" / "x.safetensors").is_symlink()  # nested: ../../../blobs

    local = fetch(str(snap_dir))
    assert local.model_id == repo and local.commit == commit and local.revision == commit
    assert local.dir == snap_dir and local.license == "apache-2.0"
    assert {f.path for f in local.files} == {"README.md", "chat_template.jinja", "config.json", "model.safetensors",
                                             "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    for f in local.files:  # hashed through the links: the blob bytes
        assert f.sha256 == sha256(snap_dir / f.path) and f.size == (snap_dir / f.path).stat().st_size
    assert local.file("config.json") == snap_dir / "config.json"  # later steps read through the same fence
    assert local.safetensors_files() == [snap_dir / "model.safetensors"]
    assert json.loads(local.file("config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    online = fetch(f"hf://{repo}@{commit}")
    assert (online.model_id, online.commit, online.files) == (local.model_id, local.commit, local.files)
    assert build_id_of(local) == build_id_of(online)
    # --model-id still overrides the derived one.
    assert fetch(str(snap_dir), f"{ORG}/renamed").model_id == f"{ORG}/renamed"


@pytest.mark.parametrize("where", ["outside", "sibling-repo"])
def test_hf_cache_symlink_leaving_its_repo_tree_is_refused(tiny_llama, tmp_path, where):
    hub = tmp_path / "hub"
    commit = "1" * 40
    snap_dir = hf_cache_snapshot(hub, f"{ORG}/m", commit, tiny_llama)
    assert fetch(str(snap_dir)).commit == commit  # the layout itself is accepted

    # A real, valid config.json as the target: only the fence can refuse it.
    if where == "outside":
        target = tmp_path / "elsewhere" / "config.json"
    else:
        target = hub / f"models--{ORG}--other" / "blobs" / sha256(tiny_llama / "config.json")
    target.parent.mkdir(parents=True)
    shutil.copy(tiny_llama / "config.json", target)
    (snap_dir / "config.json").unlink()
    (snap_dir / "config.json").symlink_to(os.path.relpath(target, snap_dir))
    assert (snap_dir / "config.json").read_bytes() == (tiny_llama / "config.json").read_bytes()
    with pytest.raises(SourceError) as ei:
        fetch(str(snap_dir))
    msg = one_line_error(ei.value)
    assert "'config.json'" in msg and "outside" in msg and f"models--{ORG}--m" in msg


def test_hf_cache_symlink_to_system_file_is_refused(tiny_llama, tmp_path):
    snap_dir = hf_cache_snapshot(tmp_path / "hub", f"{ORG}/m", "2" * 40, tiny_llama)
    (snap_dir / "tokenizer.json").unlink()
    (snap_dir / "tokenizer.json").symlink_to("/etc/passwd")
    with pytest.raises(SourceError) as ei:
        fetch(str(snap_dir))
    assert "'tokenizer.json'" in one_line_error(ei.value) and "outside" in str(ei.value)


@pytest.mark.parametrize("layout", ["models--a--b/other/m", "cache--a--b/snapshots/m"])
def test_plain_directory_gets_no_hf_cache_fence(tiny_llama, tmp_path, layout):
    """Only `models--*/snapshots/<rev>` may link into its repo tree: a plain directory whose link reaches two
    levels up (where an HF snapshot's blobs would be) is refused as before, and keeps its local- revision."""
    src = copy_model(tiny_llama, tmp_path / layout)
    blobs = src.parent.parent / "blobs"
    blobs.mkdir()
    (src / "model.safetensors").rename(blobs / "weights")
    (src / "model.safetensors").symlink_to(Path("..", "..", "blobs", "weights"))
    with pytest.raises(SourceError) as ei:
        fetch(str(src))
    assert "'model.safetensors'" in one_line_error(ei.value) and "outside" in str(ei.value)
    (src / "model.safetensors").unlink()
    shutil.copy(blobs / "weights", src / "model.safetensors")
    snap = fetch(str(src))
    assert snap.model_id == "local/m" and snap.revision.startswith("local-")


def test_hf_cache_snapshot_not_named_by_a_commit_is_content_addressed(tiny_llama, tmp_path):
    snap_dir = hf_cache_snapshot(tmp_path / "hub", f"{ORG}/m", "my-edit", tiny_llama)
    snap = fetch(str(snap_dir))
    assert snap.model_id == f"{ORG}/m" and re.fullmatch(r"local-[0-9a-f]{64}", snap.commit)


def test_offline_hf_source_reuses_the_hf_cache(hf_cached, offline):
    repo, commit, hub = hf_cached
    offline(hub)
    snap_dir = hub / f"models--{ORG}--hf-cached" / "snapshots" / commit
    snap = fetch(f"hf://{repo}")
    assert snap.dir == snap_dir and snap.commit == commit and snap.model_id == repo
    assert snap.source == f"hf://{repo}" and snap.revision == "main" and snap.pinned_source == f"hf://{repo}@{commit}"
    assert snap.license == "apache-2.0" and snap.gated == "unknown"
    assert snap.files == fetch(str(snap_dir)).files
    by_sha = fetch(f"hf://{repo}@{commit}")
    assert (by_sha.dir, by_sha.revision, by_sha.files) == (snap.dir, commit, snap.files)
    assert fetch(snap.pinned_source, repo).commit == commit  # what orchestration re-resolves
    assert snapshots_of(repo) == [], "read in place: nothing copied into hive-aot's cache"


def test_offline_hf_source_from_env_in_a_fresh_process(hf_cached, offline, tmp_path):
    """huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE at import: a new process sees only the env."""
    repo, commit, hub = hf_cached
    offline(hub)
    code = ("import json, sys; from pipelines.source.fetch import fetch; "
            "s = fetch(sys.argv[1]); print(json.dumps([s.commit, s.local_dir]))")
    res = subprocess.run([sys.executable, "-c", code, f"hf://{repo}@main"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout) == [commit, str(hub / f"models--{ORG}--hf-cached" / "snapshots" / commit)]
    # `hive-aot check hf://...` offline classifies the cached snapshot instead of asking the Hub for headers
    check = subprocess.run([sys.executable, "-m", "pipelines.cli", "check", f"hf://{repo}", "--json"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-3000:]
    doc = json.loads(check.stdout)
    assert (doc["model_id"], doc["commit"], doc["status"]) == (repo, commit, "compatible")


def test_offline_hf_source_prefers_hive_aot_cache(hf_cached, offline):
    """A commit hive-aot already fetched is served from its own snapshot, even if the HF cache has it too."""
    repo, commit, hub = hf_cached
    online = fetch(f"hf://{repo}@main")  # into this test's empty hive-aot cache, through the mirror
    assert snapshots_of(repo) == [online.dir]
    offline(hub)
    snap = fetch(f"hf://{repo}")
    assert snap.dir == online.dir and snap.commit == commit and snap.files == online.files
    assert snap.gated is False and snap.source == f"hf://{repo}" and snap.revision == "main"


def test_offline_hf_source_with_nothing_cached_is_one_line_error(offline):
    offline()
    repo = f"{ORG}/never-fetched"
    with pytest.raises(SourceError) as ei:
        fetch(f"hf://{repo}")
    msg = one_line_error(ei.value)
    assert repo in msg and "'main'" in msg and "HF_HUB_OFFLINE" in msg
    assert str(Path(os.environ["HF_HUB_CACHE"]) / f"models--{ORG}--never-fetched" / "refs" / "main") in msg

    sha = "3" * 40
    with pytest.raises(SourceError) as ei:
        fetch(f"hf://{repo}@{sha}")
    msg = one_line_error(ei.value)
    assert repo in msg and sha in msg and "HF_HUB_OFFLINE" in msg
    assert str(Path(os.environ["HIVE_AOT_CACHE"]) / "snapshots" / model_slug(repo) / sha) in msg
    assert str(Path(os.environ["HF_HUB_CACHE"]) / f"models--{ORG}--never-fetched" / "snapshots" / sha) in msg


def test_offline_hf_source_with_revision_not_in_refs(hf_cached, offline):
    repo, commit, hub = hf_cached
    offline(hub)
    with pytest.raises(SourceError) as ei:
        fetch(f"hf://{repo}@v2")
    msg = one_line_error(ei.value)
    assert repo in msg and "'v2'" in msg and "HF_HUB_OFFLINE" in msg and str(hub) in msg
    # A revision is a name inside refs/, never a path out of it.
    with pytest.raises(SourceError) as ei:
        fetch(f"hf://{repo}@../../../etc/passwd")
    assert "../../../etc/passwd" in one_line_error(ei.value)
    assert fetch(f"hf://{repo}@main").commit == commit  # the control: the same cache serves main
