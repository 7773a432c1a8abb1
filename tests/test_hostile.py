"""Hostile arguments and a damaged store, through the CLI as a user or an attacker drives it.

Every case asserts the exit code; exactly one `hive-aot: error:` line on stderr (or success), no
traceback; nothing published for a refused case; and nothing written outside the store and the
destination (each case runs in an empty working directory that must stay empty).
The CLI runs in-process (`pipelines.cli.main`), so a case costs milliseconds, not an interpreter start.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from factories import write_test_config

from pipelines.cli.main import main

REPO = Path.cwd()
MODEL = "test-org/hostile"
SLUG = "test-org--hostile"


@dataclass
class Run:
    rc: int
    out: str
    err: str

    def error_line(self) -> str:
        # exactly the one line: no traceback, and no library warnings around it (a build's step lines aside)
        lines = [line for line in self.err.strip().splitlines() if not line.startswith("hive-aot: [")]
        assert len(lines) == 1 and lines[0].startswith("hive-aot: error: "), self.err
        return lines[0]


@pytest.fixture(scope="module")
def published(tiny_llama, tmp_path_factory) -> dict:
    """One published f16 build of the tiny model, copied per case by `store`."""
    root = tmp_path_factory.mktemp("hostile")
    reg = write_test_config(root / "cfg", REPO)
    store = root / "store"
    rc = main(["build", str(tiny_llama), "--recipe", "gguf-f16", "--model-id", MODEL, "--store", str(store),
               "--registry", str(reg), "--json"])
    assert rc == 0
    manifest = next((store / "manifests" / SLUG / "gguf-f16").glob("*.json"))
    return {"store": store, "registry": reg, "model": tiny_llama, "manifest": json.loads(manifest.read_text())}


@pytest.fixture
def cli(tmp_path, monkeypatch, capfd):
    """Run the CLI in an empty working directory; returns (Run, files created in that directory)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))

    def run(*argv: str) -> Run:
        capfd.readouterr()
        rc = main(list(argv))
        captured = capfd.readouterr()
        assert sorted(p.name for p in cwd.iterdir()) == [], "wrote into the working directory"
        return Run(rc, captured.out, captured.err)

    return run


# --- hostile arguments ---------------------------------------------------------------------------

BAD_IDS = ["noslash", "a/b/c", "team--x/model", "team/x--model", "a/" + "x" * 300, "a/..b", "a/b.", "-a/b",
           "a/b\n", "a b/c", "../etc"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_build_refuses_model_ids_pull_would_refuse(bad, published, cli, tmp_path):
    store = tmp_path / "store"
    r = cli("build", str(published["model"]), "--recipe", "gguf-f16", f"--model-id={bad}", "--store", str(store),
            "--registry", str(published["registry"]))
    assert r.rc == 1 and "is not a model id: org/name" in r.error_line()
    assert not store.exists() or not any(store.rglob("*.json"))


@pytest.mark.parametrize("bad", BAD_IDS)
def test_pull_refuses_the_same_model_ids(bad, published, cli, tmp_path):
    r = cli("pull", "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "d"), "--store", str(published["store"]),
            "--", bad)
    assert r.rc == 1 and "is not a model id: org/name" in r.error_line()
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("spec", [f"{MODEL}@c@d", f"{MODEL}@../../x", f"{MODEL}@" + "A" * 64, f"{MODEL}@"])
def test_pull_refuses_malformed_build_ids(spec, published, cli, tmp_path):
    r = cli("pull", spec, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "d"), "--store",
            str(published["store"]))
    assert r.rc == 1 and "is not a build id" in r.error_line()
    assert not (tmp_path / "d").exists()


def test_colliding_ids_cannot_both_exist(published, cli, tmp_path):
    """`team--x/model` and `team/x--model` once shared one store directory; '--' is refused in ids now,
    so `org--name` names exactly one model."""
    r = cli("pull", "test--org/hostile", "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "d"),
            "--store", str(published["store"]))
    assert r.rc == 1 and "no '--'" in r.error_line()


@pytest.mark.parametrize("uri, says", [
    ("ftp://host/x", "unknown store scheme 'ftp'"),
    ("http://host/x", "unknown store scheme 'http'"),
    ("gs://bucket/x", "unknown store scheme 'gs'"),
    ("file://relative/x", "must be absolute"),
    ("s3://", "is not s3://bucket[/prefix]"),
])
@pytest.mark.parametrize("command", ["build", "ls", "gc", "pull"])
def test_unknown_store_uris_are_refused(uri, says, command, published, cli, tmp_path):
    args = {"build": ["build", str(published["model"]), "--recipe", "gguf-f16", "--model-id", MODEL,
                      "--registry", str(published["registry"])],
            "ls": ["ls"], "gc": ["gc"],
            "pull": ["pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "d")]}[command]
    r = cli(*args, "--store", uri)
    assert r.rc == 1 and says in r.error_line()


# --- a damaged store -----------------------------------------------------------------------------

def _copy(published: dict, tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(published["store"], store)
    return store


def _ref(store: Path) -> Path:
    return store / "refs" / SLUG / "gguf-f16" / "latest"


def _manifest(store: Path) -> Path:
    return next((store / "manifests" / SLUG / "gguf-f16").glob("*.json"))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "ref-not-json": (lambda s: _ref(s).write_bytes(b"\x00garbage{"), "is not valid JSON"),
    "ref-without-build-id": (lambda s: _ref(s).write_text('{"manifest": "x"}'), "has no valid build_id"),
    "ref-is-a-list": (lambda s: _ref(s).write_text("[1, 2]"), "has no valid build_id"),
    "ref-deeply-nested": (lambda s: _ref(s).write_text("[" * 100000 + "]" * 100000), "is not valid JSON"),
    "manifest-schema-invalid": (lambda s: _manifest(s).write_text('{"build_id": 5}'), "is not a valid manifest"),
    "manifest-not-json": (lambda s: _manifest(s).write_bytes(b"\xff\xfe"), "is not a valid manifest"),
    "ref-stray-key": (lambda s: (s / "refs" / "stray").write_text("{}"), "is not refs/<model>/<recipe>/<tag>"),
}


PROFILES_DAMAGE = {  # red team round two, item 11: a damaged profiles.json was a traceback in pull
    "a list": "[1, 2]", "profiles not a list": '{"runtime_profiles": {"a": 1}}',
    "a profile not an object": '{"runtime_profiles": [1]}', "no id": '{"runtime_profiles": [{"vendor": "cpu"}]}',
    "serving a list": '{"runtime_profiles": [{"id": "llm-llamacpp-cpu", "serving": [1]}]}',
    "preference a string": '{"runtime_profiles": [{"id": "llm-llamacpp-cpu", "recipe_preference": "gguf-f16"}]}',
    "not json": "\u00ff{", "nested": "[" * 100000 + "]" * 100000,
}


@pytest.mark.parametrize("damage", sorted(PROFILES_DAMAGE))
def test_a_damaged_profiles_json_is_one_line_in_pull(damage, published, cli, tmp_path, monkeypatch):
    monkeypatch.delenv("HIVE_AOT_REGISTRY")  # a serving container without a registry reads the store's copy
    store = _copy(published, tmp_path)
    (store / "profiles.json").write_text(PROFILES_DAMAGE[damage])
    r = cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "m"), "--store", str(store))
    assert r.rc == 1 and "profiles.json" in r.error_line() and "damaged" in r.error_line()
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("command", ["ls", "gc"])
def test_damaged_store_is_one_line_in_ls_and_gc(damage, command, published, cli, tmp_path):
    store = _copy(published, tmp_path)
    breaker, says = DAMAGE[damage]
    breaker(store)
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    r = cli(command, "--store", str(store), "--min-age", "0") if command == "gc" else cli(command, "--store", str(store))
    if command == "gc" and damage.startswith("ref"):
        assert r.rc == 0  # gc reads manifests, not refs: a broken ref keeps nothing from being collected
    else:
        assert r.rc == 1 and says in r.error_line()
    # gc that cannot read every manifest deletes nothing (a blob may belong to the unreadable one)
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before


def test_corrupted_blob_is_repaired_by_the_next_build(published, cli, tmp_path):
    """A skipped build verifies the blobs it relies on; a damaged one is rebuilt and uploaded again."""
    store = _copy(published, tmp_path)
    f = published["manifest"]["files"][0]
    blob = store / "blobs" / "sha256" / f["sha256"][:2] / f["sha256"]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    blob.write_bytes(bytes(data))
    args = ("build", str(published["model"]), "--recipe", "gguf-f16", "--model-id", MODEL, "--store", str(store),
            "--registry", str(published["registry"]), "--json")
    r = cli(*args)
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    assert doc["state"] == "repaired" and doc["skipped"] is False
    assert doc["build_id"] == published["manifest"]["build_id"]
    from pipelines.core.hashing import sha256_file

    assert sha256_file(blob) == f["sha256"]
    again = json.loads(cli(*args).out)
    assert again["state"] == "skipped" and again["skipped"] is True


def test_corrupted_blob_without_its_manifest_is_replaced_on_upload(published, cli, tmp_path):
    """The manifest is gone and the blob damaged: the rebuild's upload must not trust the old bytes."""
    store = _copy(published, tmp_path)
    f = published["manifest"]["files"][0]
    blob = store / "blobs" / "sha256" / f["sha256"][:2] / f["sha256"]
    blob.write_bytes(b"\0" * f["size"])
    _manifest(store).unlink()
    r = cli("build", str(published["model"]), "--recipe", "gguf-f16", "--model-id", MODEL, "--store", str(store),
            "--registry", str(published["registry"]), "--json")
    assert r.rc == 0, r.err
    assert json.loads(r.out)["state"] == "published"
    from pipelines.core.hashing import sha256_file

    assert sha256_file(blob) == f["sha256"]


# --- hostile model directories: `check` and `build` ---------------------------------------------

def _cfg(**changes):
    def edit(d: Path) -> None:
        from factories import edit_config

        edit_config(d, **changes)
    return edit


def _raw_config(text: str):
    def edit(d: Path) -> None:
        (d / "config.json").write_text(text)
    return edit


def _poison(tensor: str, value: float):
    def edit(d: Path) -> None:
        from factories import poison_weights

        poison_weights(d, tensor=tensor, value=value)
    return edit


def _truncate(d: Path) -> None:
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])


def _nested_header(d: Path) -> None:
    import struct

    header = b"{" + b'"a":' * 0 + b'"x":' + b"[" * 100000 + b"]" * 100000 + b"}"
    header += b" " * ((8 - len(header) % 8) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)


def _pickle_only(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle: never opened


def _symlink_out(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to("/etc/passwd")


def _symlink_loop(d: Path) -> None:
    """Issue 39 item 10: a link to itself where a weights file belongs (pathlib raises RuntimeError on it)."""
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to("model.safetensors")


def _tokenizer_garbage(d: Path) -> None:
    (d / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {}, "merges": []}}')


def _remove(name: str):
    def edit(d: Path) -> None:
        (d / name).unlink()
    return edit


# name: (breaker, check exit code, build exit code, fragment both error lines share, or None when check passes)
# Exit codes: 1 error, 4 requires_review, 5 incompatible (check); build refuses what check would not pass.
MODEL_DIRS: dict[str, tuple[Callable[[Path], None], int, int, str]] = {
    "eps-negative": (_cfg(rms_norm_eps=-1e-5), 5, 1, "rms_norm_eps=-1e-05 is not plausible"),
    "eps-zero": (_cfg(rms_norm_eps=0.0), 5, 1, "rms_norm_eps=0.0 is not plausible"),
    "eps-nan": (_cfg(rms_norm_eps=float("nan")), 5, 1, "rms_norm_eps=nan is not plausible"),
    "eps-string": (_cfg(rms_norm_eps="small"), 5, 1, "rms_norm_eps='small' is not plausible"),
    "rope-theta-negative": (_cfg(rope_parameters={"rope_theta": -1.0, "rope_type": "default"}), 5, 1,
                            "rope_theta=-1.0 is not plausible"),
    "rope-theta-inf": (_cfg(rope_parameters={"rope_theta": float("inf"), "rope_type": "default"}), 5, 1,
                       "rope_theta=inf is not plausible"),
    "rope-scaling-string": (_cfg(rope_scaling="linear"), 5, 1, "rope_scaling='linear' is not plausible"),
    "rope-parameters-list": (_cfg(rope_parameters=[1, 2]), 5, 1, "rope_parameters=[1, 2] is not plausible"),
    "sliding-window-negative": (_cfg(sliding_window=-5), 5, 1, "sliding_window=-5 is not plausible"),
    "kv-heads-not-dividing": (_cfg(num_key_value_heads=3), 5, 1, "not divisible by num_key_value_heads=3"),
    "hidden-size-zero": (_cfg(hidden_size=0), 5, 1, "hidden_size"),
    "layers-absurd": (_cfg(num_hidden_layers=10**9), 5, 1, "num_hidden_layers"),
    "vocab-negative": (_cfg(vocab_size=-1), 5, 1, "vocab_size"),
    "model-type-contradicts": (_cfg(model_type="gpt2"), 5, 1, "model_type 'gpt2' contradicts architecture"),
    "model-type-not-string": (_cfg(model_type=5), 5, 1, "model_type=5 is not a string"),
    "quantization-garbage": (_cfg(quantization_config="yes"), 5, 1, "quantization_config='yes' is not an object"),
    "quantization-unknown": (_cfg(quantization_config={"quant_method": "magic"}), 5, 1, "unknown quant_method 'magic'"),
    "unknown-architecture": (_cfg(architectures=["NoSuchForCausalLM"]), 5, 1, "NoSuchForCausalLM"),
    "config-nested": (_raw_config('{"a": ' + "[" * 100000 + "]" * 100000 + "}"), 5, 1, "nested too deeply"),
    "config-not-json": (_raw_config("{architectures: llama"), 5, 1, "config.json is not valid JSON"),
    "config-a-list": (_raw_config("[1, 2, 3]"), 5, 1, "config.json is not a JSON object"),
    "config-missing": (_remove("config.json"), 1, 1, "config.json is missing"),
    # red team round two, item 12: a 5000-digit integer was a traceback (Python's int conversion limit)
    "config-5000-digits": (_raw_config('{"architectures": ["LlamaForCausalLM"], "hidden_size": ' + "1" * 5000 + "}"),
                           5, 1, "config.json is not valid JSON (Exceeds the limit"),
    "config-4000-digits": (_cfg(hidden_size=int("1" * 4000)), 5, 1, "hidden_size=1111111111111111... (4000 characters)"),
    "remote-code": (_cfg(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}), 4, 1, "requires review"),
    "nan-embedding-row": (_poison("model.embed_tokens.weight", float("nan")), 0, 1,
                          "tensor model.embed_tokens.weight has 1 non-finite value(s)"),
    "inf-mlp-weight": (_poison("model.layers.1.mlp.up_proj.weight", float("inf")), 0, 1,
                       "tensor model.layers.1.mlp.up_proj.weight has 1 non-finite value(s)"),
    "beyond-float16-range": (_poison("model.layers.0.mlp.down_proj.weight", 1.0e5), 0, 1,
                             "beyond float16's range (65504)"),
    "truncated-weights": (_truncate, 1, 1, "model.safetensors"),
    "nested-safetensors-header": (_nested_header, 1, 1, "nested too deeply"),
    "pickle-only": (_pickle_only, 1, 1, "only pickle weights (pytorch_model.bin)"),
    "symlink-out-of-repo": (_symlink_out, 1, 1, "resolves outside"),
    "symlink-loop": (_symlink_loop, 1, 1, "a symlink loop"),
    "tokenizer-garbage": (_tokenizer_garbage, 0, 1, "tokenizer"),
}


@pytest.mark.parametrize("case", sorted(MODEL_DIRS))
@pytest.mark.parametrize("command", ["check", "build"])
def test_hostile_model_directory(case, command, published, cli, tmp_path):
    from factories import copy_model

    breaker, check_rc, build_rc, fragment = MODEL_DIRS[case]
    d = copy_model(published["model"], tmp_path / "model")
    breaker(d)
    store = tmp_path / "store"
    if command == "check":
        r = cli("check", str(d), "--model-id", "test-org/bad", "--hardware", "cpu", "--json")
        assert r.rc == check_rc, r.err
        if check_rc == 0:
            assert json.loads(r.out)["status"] == "compatible"
            return
        if check_rc == 1:
            assert fragment in r.error_line()
            return
        doc = json.loads(r.out)
        assert doc["status"] == {4: "requires_review", 5: "incompatible"}[check_rc]
        assert fragment in json.dumps(doc) and "Traceback" not in r.err
        return
    r = cli("build", str(d), "--recipe", "gguf-f16", "--model-id", "test-org/bad", "--store", str(store),
            "--registry", str(published["registry"]))
    assert r.rc == build_rc and fragment in r.error_line()
    assert not (store / "manifests").exists() and not (store / "refs").exists()
    assert not (store / "staging").exists() or not any((store / "staging").iterdir())


def test_a_config_only_directory_is_answered_by_check_with_the_weights_failing(published, cli, tmp_path):
    """Item 15: a platform asks "will this run?" before downloading weights; check refused a directory holding
    only config.json ("no *.safetensors weights found"). The build still refuses it."""
    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copyfile(published["model"] / "config.json", d / "config.json")
    r = cli("check", str(d), "--model-id", "test-org/config-only", "--hardware", "cpu", "--json")
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    assert doc["status"] == "compatible" and doc["runtime_profile_id"] == "llm-llamacpp-cpu"
    weights = [c for c in doc["checks"] if c["name"] == "weights"]
    assert weights and weights[0]["status"] == "fail" and "config only" in weights[0]["detail"]
    r = cli("build", str(d), "--recipe", "gguf-f16", "--model-id", "test-org/config-only", "--store",
            str(tmp_path / "store"), "--registry", str(published["registry"]))
    assert r.rc == 1 and "no *.safetensors weights found" in r.error_line()


def test_pull_into_an_empty_dest_is_refused(published, cli, tmp_path):
    """Item 25: `pull --dest ""` wrote into the current directory."""
    r = cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", "", "--store", str(published["store"]))
    assert r.rc == 1 and "--dest is empty" in r.error_line()


@pytest.mark.parametrize("variable", ["HIVE_AOT_MEMORY_BUDGET", "HIVE_AOT_PULL_PART_SIZE"])
def test_a_huge_number_in_a_size_variable_is_one_line(variable, published, cli, tmp_path, monkeypatch):
    """Red team round two, item 12: sizes of 400 digits."""
    monkeypatch.setenv(variable, "9" * 400)
    if variable == "HIVE_AOT_MEMORY_BUDGET":
        r = cli("plan", str(published["model"]), "--recipe", "gguf-f16", "--model-id", MODEL)
    else:
        r = cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "m"), "--store",
                str(published["store"]))
    assert r.rc == 1 and variable in r.error_line() and "is not a size" in r.error_line()


# --- issue 39: secrets in store URIs, an unusable cache, a damaged signature -----------------------------------

SECRET = "s3cr3t-Tail"


@pytest.mark.parametrize("uri", [f"oci://user:pa/{SECRET}@127.0.0.1:1/repo", f"oci://127.0.0.1:1/repo?token={SECRET}",
                                 f"oci://127.0.0.1:1/repo#{SECRET}", f"s3://bucket/prefix?X-Amz-Signature={SECRET}",
                                 f"s3://user:{SECRET}@bucket/prefix", f"ftp://user:{SECRET}@host/x",
                                 f"file:///tmp/x?sig={SECRET}"])
@pytest.mark.parametrize("command", ["ls", "pull"])
def test_a_secret_in_a_store_uri_is_never_echoed(uri, command, published, cli, tmp_path, monkeypatch):
    """Item 6: user-info, query and fragment of a store URI are refused and never printed, whichever scheme."""
    args = ["ls"] if command == "ls" else ["pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "d")]
    r = cli(*args, "--store", uri)
    line = r.error_line()
    assert r.rc == 1 and SECRET not in line and SECRET not in r.out and "***" in line
    monkeypatch.setenv("HIVE_AOT_STORE", uri)
    r = cli("settings", "--json")
    assert r.rc == 0 and SECRET not in r.out + r.err


@pytest.mark.parametrize("cache", ["a-file", "dev-null", "fan-out-a-file"])
def test_an_unusable_blob_cache_is_one_line_in_pull(cache, published, cli, tmp_path, monkeypatch):
    """Item 9 and 13: HIVE_AOT_CACHE naming a file or /dev/null, or a fan-out level of the cache that is a file,
    was NotADirectoryError in pull."""
    root = tmp_path / "cache-root"
    if cache == "a-file":
        root.write_text("not a directory")
    elif cache == "dev-null":
        root = Path("/dev/null")
    else:
        digest = published["manifest"]["files"][0]["sha256"]
        (root / "blobs" / "sha256").mkdir(parents=True)
        (root / "blobs" / "sha256" / digest[:2]).write_text("not a directory")
    monkeypatch.setenv("HIVE_AOT_CACHE", str(root))
    r = cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "d"), "--store",
            str(published["store"]))
    assert r.rc == 1 and "is not a directory" in r.error_line() and "HIVE_AOT_CACHE" in r.error_line()
    assert not (tmp_path / "d").exists()


def _sign(published: dict, tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """A copy of the store whose manifest carries a signature; (store, signature file, public key file)."""
    from factories import ecdsa_keypair

    from pipelines.store import open_store
    from pipelines.store.signing import signature_key, write_signature

    store = _copy(published, tmp_path)
    key, public = ecdsa_keypair(tmp_path, "publisher")
    monkeypatch.setenv("HIVE_AOT_SIGNING_KEY", str(key))
    mkey = str(_manifest(store).relative_to(store))
    assert write_signature(open_store(str(store)), mkey, _manifest(store).read_bytes())
    monkeypatch.delenv("HIVE_AOT_SIGNING_KEY")
    return store, store / signature_key(mkey), public


@pytest.mark.parametrize("damage", ["key-id-a-list", "key-id-an-object", "a-directory", "a-fifo"])
def test_a_damaged_signature_is_one_line_in_pull(damage, published, cli, tmp_path, monkeypatch):
    """Item 13: a key id that is a list or an object was `TypeError: unhashable type`, a signature path that is a
    directory `IsADirectoryError` (a FIFO would block the read forever). The key id is now the OMS bundle's hint."""
    import os

    store, sig, public = _sign(published, tmp_path, monkeypatch)
    if damage.startswith("key-id"):
        doc = json.loads(sig.read_text())
        hint = doc["verificationMaterial"]["publicKey"]["hint"]
        doc["verificationMaterial"]["publicKey"]["hint"] = [hint] if damage == "key-id-a-list" else {"id": hint}
        sig.write_text(json.dumps(doc))
    else:
        sig.unlink()
        sig.mkdir() if damage == "a-directory" else os.mkfifo(sig)
    r = cli("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "d"), "--store", str(store),
            "--trusted-keys", str(public))
    assert r.rc == 1 and ("signature is malformed" in r.error_line() or "not a regular file" in r.error_line())
    assert not (tmp_path / "d").exists()
