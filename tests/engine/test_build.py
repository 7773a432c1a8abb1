"""The build engine end to end on a tiny real model: fetch, classify, convert, validate with llama.cpp, publish."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from factories import copy_model, edit_config, poison_weights, rewrite_safetensors_header, write_test_config

from pipelines.config.registry import Config
from pipelines.core.errors import ConfigError, HiveError, StoreError, ValidationFailed
from pipelines.core.paths import cache_root
from pipelines.engine.build import build_and_publish, plan, publish_staged, stage, validate_staged
from pipelines.store import open_store
from pipelines.store.manifest import Manifest, compute_build_id

REPO = Path.cwd()
MODEL = "test-org/tiny-llama"
SLUG = "test-org--tiny-llama"


def _files(root: Path) -> list[str]:
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _visible(root: Path) -> list[str]:
    """What a reader of the store could see as published or pending."""
    return [f for f in _files(root) if f.startswith(("manifests/", "refs/", "staging/"))]


def _local_revision(model_dir: Path) -> str:
    """DESIGN: local-<sha256 of the sorted (path, sha256) list>, computed here independently."""
    pairs = sorted([p.name, hashlib.sha256(p.read_bytes()).hexdigest()] for p in model_dir.iterdir() if p.is_file())
    return "local-" + hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()


@pytest.fixture(scope="module")
def tconfig(tmp_path_factory):
    """The project's registry and recipes with test gates for random-weight models (see factories.TEST_GATES)."""
    return Config.load(write_test_config(tmp_path_factory.mktemp("cfg"), REPO))


@pytest.fixture(scope="module")
def published(tiny_llama, tconfig, tmp_path_factory):
    """One f16 build of the tiny model, published into a module-wide store."""
    store = tmp_path_factory.mktemp("published") / "store"
    res = build_and_publish(str(tiny_llama), "gguf-f16", tconfig, str(store), MODEL)
    return store, res


def test_publish_layout_matches_the_design(published, tiny_llama, tconfig):
    config = tconfig
    store, res = published
    assert res.state == "published" and res.skipped is False
    assert res.validation["passed"] is True and res.validation["failures"] == []
    gate = tconfig.recipe("gguf-f16").validation
    assert res.validation["metrics"]["top1_agreement"] >= gate.min_top1_agreement
    assert res.validation["metrics"]["mean_kl"] <= gate.max_mean_kl and res.validation["metrics"]["finite"] is True
    assert res.validation["thresholds"] == gate.model_dump(mode="json")

    rev = _local_revision(tiny_llama)
    bid = res.build_id
    assert len(bid) == 64 and all(c in "0123456789abcdef" for c in bid)
    (entry,) = res.files
    blob = f"blobs/sha256/{entry['sha256'][:2]}/{entry['sha256']}"
    mkey = f"manifests/{SLUG}/gguf-f16/{bid}.json"
    assert _files(store) == sorted([blob, mkey, f"refs/{SLUG}/gguf-f16/latest", f"refs/{SLUG}/gguf-f16/{rev}",
                                    "profiles.json"])
    assert res.manifest == f"{store.as_uri()}/{mkey}"

    # the blob is the artifact, verified by its name
    data = (store / blob).read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["size"]
    assert data[:4] == b"GGUF"
    assert entry["path"] == "tiny-llama-F16.gguf"

    raw = (store / mkey).read_bytes()
    m = Manifest.model_validate_json(raw)
    assert raw == m.to_bytes()  # canonical bytes
    doc = json.loads(raw)
    assert doc["schema_version"] == 1 and doc["build_id"] == bid
    assert doc["model"]["id"] == MODEL and doc["model"]["revision"] == rev == doc["model"]["commit"]
    assert doc["model"]["source"] == "local" and doc["model"]["gated"] is False
    assert doc["recipe"]["id"] == "gguf-f16" and doc["recipe"]["digest"] == config.recipe("gguf-f16").digest
    assert doc["runtime_profiles"] == ["llm-llamacpp-cpu"] and doc["format"] == "gguf"
    assert doc["files"] == res.files
    assert {"gguf", "llama_cpp_python", "transformers", "hive_aot_gguf_format"} <= set(doc["toolchain"])
    cpu = doc["serving"]["llm-llamacpp-cpu"]  # one description per runtime profile
    assert cpu["engine"] == "llama.cpp" and cpu["model_file"] == entry["path"]
    assert cpu["command"][:3] == ["llama-server", "-m", "{model_dir}/" + entry["path"]]
    assert cpu["image"] == "registry.colabhive.com/inference-llamacpp-cpu"
    assert doc["validation"]["passed"] is True
    assert "created_at" not in raw.decode() and str(store) not in raw.decode()  # no timestamps, no local paths

    # the build id is recomputable from what the manifest records
    snap_files = sorted((p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in tiny_llama.iterdir() if p.is_file())
    assert bid == compute_build_id(MODEL, rev, snap_files, config.recipe("gguf-f16").canonical_json(), doc["toolchain"])

    for tag in ("latest", rev):
        ref = json.loads((store / f"refs/{SLUG}/gguf-f16/{tag}").read_text())
        assert ref["build_id"] == bid and ref["manifest"] == mkey
        assert ref["manifest_sha256"] == hashlib.sha256(raw).hexdigest()
        assert ref["created_at"].endswith("+00:00")

    profiles = json.loads((store / "profiles.json").read_text())
    assert {p["id"] for p in profiles["runtime_profiles"]} == {p.id for p in config.registry.runtime_profiles}


def test_rebuild_in_a_fresh_store_is_byte_identical(published, tiny_llama, tconfig, tmp_path):
    store, first = published
    fresh = tmp_path / "fresh"
    second = build_and_publish(str(tiny_llama), "gguf-f16", tconfig, str(fresh), MODEL)
    assert second.state == "published" and second.build_id == first.build_id
    assert second.files == first.files  # identical blob digests: the build is deterministic
    mkey = f"manifests/{SLUG}/gguf-f16/{first.build_id}.json"
    assert (fresh / mkey).read_bytes() == (store / mkey).read_bytes()
    for f in first.files:
        key = f"blobs/sha256/{f['sha256'][:2]}/{f['sha256']}"
        assert (fresh / key).read_bytes() == (store / key).read_bytes()


def test_same_inputs_are_skipped(published, tiny_llama, tconfig):
    store, first = published
    before = {f: (store / f).stat().st_mtime_ns for f in _files(store)}
    res = build_and_publish(str(tiny_llama), "gguf-f16", tconfig, str(store), MODEL)
    assert res.state == "skipped" and res.skipped is True
    assert res.build_id == first.build_id and res.manifest == first.manifest and res.files == first.files
    assert {f: (store / f).stat().st_mtime_ns for f in _files(store)} == before  # nothing rewritten


def test_unchanged_answers_what_the_skipped_build_would_without_building(published, tiny_llama, tconfig, tmp_path):
    """build.unchanged over planning.plan_each (a no-op onboarding's question): the skipped result for inputs as
    published, None as soon as there is work: another recipe, changed weights, a damaged blob; a recipe that
    cannot be planned has no plan at all (its build says why)."""
    from pipelines.engine.build import unchanged
    from pipelines.engine.planning import plan_each

    store, first = published
    opened = open_store(str(store))
    before = {f: (store / f).stat().st_mtime_ns for f in _files(store)}
    plans = plan_each(str(tiny_llama), ["gguf-f16", "gguf-q8_0", "no-such-recipe"], tconfig, MODEL)
    assert sorted(plans) == ["gguf-f16", "gguf-q8_0"]
    res = unchanged(plans["gguf-f16"], opened)
    assert res is not None and res.state == "skipped" and res.build_id == first.build_id
    assert res.files == first.files and res.manifest == first.manifest
    assert {f: (store / f).stat().st_mtime_ns for f in _files(store)} == before
    assert unchanged(plans["gguf-q8_0"], opened) is None  # never built
    changed = copy_model(tiny_llama, tmp_path / "changed")
    edit_config(changed, rms_norm_eps=2e-5)
    assert unchanged(plan_each(str(changed), ["gguf-f16"], tconfig, MODEL)["gguf-f16"], opened) is None  # inputs moved
    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    blob = next(p for p in (damaged / "blobs").rglob("*") if p.is_file() and p.stat().st_size > 1000)
    blob.write_bytes(b"\0" * blob.stat().st_size)  # same size, other bytes: only the content check sees it
    assert unchanged(plans["gguf-f16"], open_store(str(damaged))) is None
    assert plan_each(str(tmp_path / "no-such-model"), ["gguf-f16"], tconfig, MODEL) == {}


def test_a_concurrent_builder_that_publishes_first_leaves_this_one_skipped(tiny_llama, tconfig, tmp_path, monkeypatch):
    """Two builders of one build share its staging record: the one that commits first deletes it, and the other,
    still validating, finds none. That one answers skipped (the build is published), not an error; a staging
    record gone with nothing published is still the store's error."""
    import pipelines.engine.build as build
    from pipelines.store import staging_key

    real = build.validate_staged

    def other_builder_commits_first(p, store):
        assert real(p, store).passed
        build.publish_staged(p, store)  # the other builder's commit: the staging record goes
        return real(p, store)

    monkeypatch.setattr(build, "validate_staged", other_builder_commits_first)
    res = build_and_publish(str(tiny_llama), "gguf-f16", tconfig, str(tmp_path / "store"), MODEL)
    assert res.state == "skipped" and res.skipped is True and _visible(tmp_path / "store")

    def staging_lost(p, store):
        store.delete(staging_key(p.build_id))
        return real(p, store)

    monkeypatch.setattr(build, "validate_staged", staging_lost)
    with pytest.raises(StoreError, match="no staged candidate"):
        build_and_publish(str(tiny_llama), "gguf-f16", tconfig, str(tmp_path / "other-store"), MODEL)


def test_build_id_is_content_addressed(tiny_llama, config, tmp_path):
    base = plan(str(tiny_llama), "gguf-f16", config, MODEL).build_id

    # the same content elsewhere, plus files a build never reads: same id
    moved = copy_model(tiny_llama, tmp_path / "elsewhere")
    (moved / "notes.txt").write_text("not part of the model")
    (moved / "pytorch_model.bin").write_bytes(b"never read")
    assert plan(str(moved), "gguf-f16", config, MODEL).build_id == base

    # one weight changed: new revision, new id
    poison_weights(moved, value=0.5)
    p = plan(str(moved), "gguf-f16", config, MODEL)
    assert p.build_id != base and p.snapshot.revision != _local_revision(tiny_llama)

    # another model id or recipe: new id
    assert plan(str(tiny_llama), "gguf-f16", config, "test-org/other").build_id != base
    assert plan(str(tiny_llama), "gguf-q8_0", config, MODEL).build_id != base


def test_build_id_changes_with_recipe_options(tiny_llama, config, tmp_path):
    base = plan(str(tiny_llama), "gguf-f16", config, MODEL)
    reg = write_test_config(tmp_path / "cfg", REPO, gates={})
    same = Config.load(reg)
    assert plan(str(tiny_llama), "gguf-f16", same, MODEL).build_id == base.build_id

    p = tmp_path / "cfg" / "recipes" / "gguf-f16.yaml"
    data = yaml.safe_load(p.read_text())
    data["description"] = "reworded: not part of the id"
    p.write_text(yaml.safe_dump(data))
    assert plan(str(tiny_llama), "gguf-f16", Config.load(reg), MODEL).build_id == base.build_id

    data["options"] = {"outtype": "f16", "bpe_pre_fallback": "smollm"}
    p.write_text(yaml.safe_dump(data))
    assert plan(str(tiny_llama), "gguf-f16", Config.load(reg), MODEL).build_id != base.build_id


def test_interrupted_publish_is_repaired(published, tiny_llama, tconfig, tmp_path):
    src, first = published
    store = tmp_path / "store"
    shutil.copytree(src, store)
    refs = [f for f in _files(store) if f.startswith("refs/")]
    assert len(refs) == 2
    for r in refs:
        (store / r).unlink()  # a publisher died after writing the manifest
    res = build_and_publish(str(tiny_llama), "gguf-f16", tconfig, str(store), MODEL)
    assert res.state == "skipped" and res.build_id == first.build_id
    assert [f for f in _files(store) if f.startswith("refs/")] == refs
    mbytes = (store / f"manifests/{SLUG}/gguf-f16/{first.build_id}.json").read_bytes()
    for r in refs:
        ref = json.loads((store / r).read_text())
        assert ref["build_id"] == first.build_id and ref["manifest_sha256"] == hashlib.sha256(mbytes).hexdigest()


def test_integrity_names_a_damaged_or_missing_blob(published, tiny_llama, tconfig, tmp_path):
    """What Dagster's blocking `integrity` check reports: intact after publishing; a blob whose bytes changed
    (same size) or that is gone, each as one line naming the file."""
    from pipelines.engine.build import integrity_problems

    src, first = published
    store_dir = tmp_path / "store"
    shutil.copytree(src, store_dir)
    store = open_store(str(store_dir))
    p = plan(str(tiny_llama), "gguf-f16", tconfig, MODEL)
    assert integrity_problems(p, store) == []
    (entry,) = first.files
    blob = store_dir / "blobs" / "sha256" / entry["sha256"][:2] / entry["sha256"]
    if not blob.exists():
        (blob,) = [b for b in store_dir.rglob(entry["sha256"]) if b.is_file()]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    (line,) = integrity_problems(p, store)
    assert line == (f"{entry['path']}: blob {entry['sha256'][:12]} in {store.uri} does not hold its {entry['size']} "
                    "bytes and sha256")
    blob.unlink()
    assert integrity_problems(p, store) == [f"{entry['path']}: blob {entry['sha256'][:12]} is missing from {store.uri}"]


# --- bad inputs: one clear line, nothing visible in the store ----------------------------------

def _truncate(d: Path) -> None:
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])


def _shape_mismatch(d: Path) -> None:
    def edit(h):
        h["model.norm.weight"]["shape"] = [65]
    rewrite_safetensors_header(d / "model.safetensors", edit)


def _offsets_past_end(d: Path) -> None:
    def edit(h):
        last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        s, e = h[last]["data_offsets"]
        h[last]["data_offsets"] = [s + 4096, e + 4096]
    rewrite_safetensors_header(d / "model.safetensors", edit)


def _pickle_only(d: Path) -> None:
    (d / "model.safetensors").rename(d / "pytorch_model.bin")


BAD_INPUTS = {
    "unknown_architecture": (lambda d: edit_config(d, architectures=["FancyNewForCausalLM"]),
                             "FancyNewForCausalLM is not in the architecture database"),
    "no_architectures": (lambda d: edit_config(d, architectures=None), "config.json has no architectures field"),
    "missing_config": (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    "malformed_config": (lambda d: (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],'),
                         "config.json is not valid JSON"),
    "truncated_safetensors": (_truncate, "truncated safetensors file"),
    "shape_mismatch": (_shape_mismatch, "do not match its shape [65] BF16"),
    "offsets_past_end": (_offsets_past_end, "data section has"),
    "vocab_mismatch": (lambda d: edit_config(d, vocab_size=50000),
                       "config vocab_size=50000 but model.embed_tokens.weight has 49152 rows"),
    "absurd_sizes": (lambda d: edit_config(d, num_hidden_layers=10 ** 6), "num_hidden_layers=1000000 is not plausible"),
    "malformed_tokenizer": (lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": '),
                            "tokenizer"),
    "auto_map_unreviewed": (lambda d: edit_config(d, auto_map={"AutoModelForCausalLM": "modeling_x.X"}),
                            "requires review"),
    "recipe_not_applicable": (lambda d: edit_config(d, architectures=["OPTForCausalLM"], model_type="opt"),
                              "recipe gguf-f16 does not apply to test-org/bad (OPTForCausalLM)"),
    "pickle_only": (_pickle_only, "only pickle weights (pytorch_model.bin)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_and_leaves_nothing(case, tiny_llama, config, tmp_path):
    breaker, fragment = BAD_INPUTS[case]
    d = copy_model(tiny_llama, tmp_path / "bad")
    breaker(d)
    store = tmp_path / "store"
    with pytest.raises(HiveError) as ei:
        build_and_publish(str(d), "gguf-f16", config, str(store), "test-org/bad")
    msg = str(ei.value)
    assert "\n" not in msg and fragment in msg, msg
    assert ei.value.exit_code == 1
    assert _visible(store) == []
    assert _files(cache_root() / "work") == []  # build scratch is cleaned up


def test_unknown_recipe(tiny_llama, config, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown recipe 'gguf-q1' \(known: "):
        build_and_publish(str(tiny_llama), "gguf-q1", config, str(tmp_path / "store"), MODEL)
    assert _visible(tmp_path / "store") == []


def test_unwritable_store(tiny_llama, config, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="is not writable") as ei:
        build_and_publish(str(tiny_llama), "gguf-f16", config, str(blocker / "store"), MODEL)
    assert "\n" not in str(ei.value)
    # checked before any source work: even a broken source reports the store first
    with pytest.raises(StoreError, match="is not writable"):
        build_and_publish(str(tmp_path / "missing-model"), "gguf-f16", config, str(blocker / "store"), MODEL)


def test_nan_weights_are_refused_while_converting(tiny_llama, config, tmp_path):
    """NaN/Inf are found as tensors stream through conversion, even where no prompt's logits would show
    them: nothing is uploaded, staged or published."""
    d = copy_model(tiny_llama, tmp_path / "nan")
    poison_weights(d)
    store = tmp_path / "store"
    with pytest.raises(HiveError, match=r"test-org/nan: tensor \S+ has 1 non-finite value\(s\) \(NaN/Inf\)"):
        build_and_publish(str(d), "gguf-f16", config, str(store), "test-org/nan")
    assert _files(store) == []
    assert _files(cache_root() / "work") == []


def test_unvalidated_candidate_cannot_be_published(tiny_llama, tmp_path):
    # gates no real artifact can meet: the candidate stages, then fails validation
    strict = Config.load(write_test_config(tmp_path / "cfg", REPO, gates={"gguf-f16": {
        "min_top1_agreement": 1.0, "max_mean_kl": 0.0, "max_abs_logit_delta": 0.0, "require_token_parity": True}}))
    store = open_store(str(tmp_path / "store"))
    p = plan(str(tiny_llama), "gguf-f16", strict, "test-org/strict")
    staged = stage(p, store)
    assert staged.state == "staged" and staged.manifest.endswith(f"/staging/{p.build_id}.json")
    assert _visible(store.root) == [f"staging/{p.build_id}.json"]
    with pytest.raises(ValidationFailed, match="is staged, not validated: refusing to publish") as ei:
        publish_staged(p, store, strict)
    assert ei.value.exit_code == 3
    report = validate_staged(p, store)
    assert report.passed is False
    assert _visible(store.root) == []  # the rejected candidate's staging record is gone
    with pytest.raises(StoreError, match="no staged candidate"):
        publish_staged(p, store, strict)
    assert _visible(store.root) == []


def test_auto_map_builds_when_reviewed_and_never_imports_its_code(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "remote")
    sentinel = tmp_path / "SENTINEL"
    code = f"open({str(sentinel)!r}, 'w').write('remote code ran')\n"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py"):
        (d / name).write_text(code)
    edit_config(d, auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                             "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))

    unreviewed = Config.load(write_test_config(tmp_path / "u", REPO, models=[{"id": "test-org/remote", "recipes": ["gguf-f16"]}]))
    with pytest.raises(HiveError, match="requires review"):
        build_and_publish(str(d), "gguf-f16", unreviewed, str(tmp_path / "store"), "test-org/remote")

    reviewed = Config.load(write_test_config(tmp_path / "r", REPO, models=[
        {"id": "test-org/remote", "recipes": ["gguf-f16"], "reviewed": True}]))
    res = build_and_publish(str(d), "gguf-f16", reviewed, str(tmp_path / "store"), "test-org/remote")
    assert res.state == "published", res.validation
    assert not sentinel.exists()
    assert os.path.isfile(tmp_path / "store" / f"manifests/test-org--remote/gguf-f16/{res.build_id}.json")


def test_gc_during_a_build_never_leaves_a_manifest_naming_a_gone_blob(tiny_llama, tconfig, tmp_path, monkeypatch):
    """Red team round two, item 6: `gc --min-age 0` between staging and publishing deleted the staged build's
    blobs, and the build then published a manifest naming them (exit 0)."""
    import time

    from pipelines.client.inventory import gc
    from pipelines.store import blob_key, staging_key, staging_lease

    store = open_store(str(tmp_path / "store"))
    p = plan(str(tiny_llama), "gguf-f16", tconfig, "test-org/gc-race")
    stage(p, store)
    # a validating builder keeps its record fresh: here, gc runs in the middle of the validation
    monkeypatch.setattr(staging_lease, "LEASE_REFRESH_S", 0.05)
    real_validate = p.target.validate

    def validate_while_gc_runs(*args, **kwargs):
        time.sleep(0.2)  # at least one refresh
        assert gc(str(tmp_path / "store"), min_age_s=0)["blobs"] == []
        return real_validate(*args, **kwargs)

    monkeypatch.setattr(p.target, "validate", validate_while_gc_runs)
    assert validate_staged(p, store).passed
    monkeypatch.undo()
    assert store.read_json(staging_key(p.build_id))["state"] == "validated"  # the refresh never put back "staged"
    # a gc that took the blobs anyway (a lease that ran out: a validation elsewhere that never refreshed it)
    files = store.read_json(staging_key(p.build_id))["manifest"]["files"]
    store.delete(blob_key(files[0]["sha256"]))
    with pytest.raises(StoreError, match=r"lost 1 blob\(s\) before publishing .* nothing was published"):
        publish_staged(p, store, tconfig)
    assert _visible(store.root) == []  # no manifest, no ref, no candidate


def test_gc_takes_a_dead_builders_record_only_after_the_lease(tiny_llama, tconfig, tmp_path):
    import os
    import time

    from pipelines.client.inventory import gc
    from pipelines.store import staging_key, staging_lease

    store = open_store(str(tmp_path / "store"))
    p = plan(str(tiny_llama), "gguf-f16", tconfig, "test-org/gc-lease")
    stage(p, store)
    record = store.root / staging_key(p.build_id)
    assert gc(str(tmp_path / "store"), min_age_s=0)["staging"] == []  # within the lease whatever --min-age says
    old = time.time() - staging_lease.LEASE_S - 60
    os.utime(record, (old, old))
    res = gc(str(tmp_path / "store"), min_age_s=0)
    assert res["staging"] == [f"staging/{p.build_id}.json"] and len(res["blobs"]) == 1 and not record.exists()


def test_the_cpu_serve_command_uses_the_context_check_recommends(tiny_llama, tconfig, tmp_path):
    """Red team round two, item 19: the CPU serve command capped llama-server at -c 4096 while
    `check --hardware cpu` recommended 8192."""
    from pipelines.compat.check import classify_snapshot
    from pipelines.source.fetch import fetch

    d = copy_model(tiny_llama, tmp_path / "long")
    edit_config(d, max_position_embeddings=32768)
    p = plan(str(d), "gguf-f16", tconfig, "test-org/long-context", hashed=False)  # what a build records, unbuilt
    serving = p.target.serving(p.context, ["long-context-F16.gguf"])["llm-llamacpp-cpu"]
    snap = fetch(str(d), "test-org/long-context", hashed=False)
    recommended = classify_snapshot(snap, tconfig.recipes.values(), hardware="cpu", registry=tconfig.registry)
    n_ctx = recommended.estimated_requirements["recommended_config"]["max_model_len"]
    assert n_ctx == 8192 and serving["n_ctx"] == n_ctx
    assert serving["command"][serving["command"].index("-c") + 1] == str(n_ctx)
