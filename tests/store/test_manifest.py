"""pipelines/store/manifest.py: the manifest document and the build id.

A manifest is stored as canonical bytes and read back by every pull, gc and skip check: the round trip must be
exact, the bytes independent of how the document was assembled, and damage one IntegrityError line naming
where it was read. The build id is checked against a digest written out by hand (published ids must stay the
same across releases) and against each of its ingredients.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from pipelines.core.errors import IntegrityError
from pipelines.store.manifest import FileEntry, Manifest, ModelInfo, RecipeInfo, compute_build_id

WHERE = "file:///store: manifests/org/m/gguf-f16/abc.json"


def manifest_doc(files: list[dict], **changes) -> dict:
    doc = {
        "build_id": "ab" * 32,
        "model": {"id": "org/m", "revision": "main", "commit": "c" * 40, "source": "hf", "license": "apache-2.0",
                  "content_digest": "d" * 64},
        "recipe": {"id": "gguf-f16", "kind": "gguf", "digest": "e" * 64, "options": {"outtype": "f16"}},
        "runtime_profiles": ["llm-llamacpp-cpu"],
        "format": "gguf",
        "files": files,
        "toolchain": {"gguf": "0.19.0", "hive_aot_gguf_format": "1"},
        "build": {"seconds_total": 1.5},
        "validation": {"passed": True, "metrics": {"top1_agreement": 0.99}},
    }
    doc.update(changes)
    return doc


@pytest.fixture
def artifact_files(tmp_path) -> list[dict]:
    """Two real files; their entries from hashlib and stat, not from the project's code."""
    entries = []
    for name, data in (("m-f16.gguf", b"GGUF" + bytes(range(256)) * 40), ("README.md", "héllo\n".encode())):
        (tmp_path / name).write_bytes(data)
        entries.append({"path": name, "sha256": hashlib.sha256(data).hexdigest(), "size": (tmp_path / name).stat().st_size})
    return entries


def test_round_trip_is_exact_and_the_bytes_are_canonical(artifact_files):
    m = Manifest.parse(manifest_doc(artifact_files), WHERE)
    raw = m.to_bytes()
    assert Manifest.parse(raw, WHERE) == m
    assert Manifest.parse(raw.decode(), WHERE) == m  # stored text reads the same
    assert Manifest.parse(raw, WHERE).to_bytes() == raw
    # canonical: sorted keys, no spaces, one trailing newline; what json itself writes for the document
    assert raw.endswith(b"}\n") and raw.count(b"\n") == 1
    assert raw[:-1] == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert json.loads(raw)["schema_version"] == 1  # written even though the document did not say it


def test_the_bytes_do_not_depend_on_how_the_document_was_assembled(artifact_files):
    doc = manifest_doc(artifact_files)
    reordered = {k: doc[k] for k in reversed(list(doc))}
    reordered["model"] = {k: doc["model"][k] for k in reversed(list(doc["model"]))}
    built = Manifest(build_id=doc["build_id"], model=ModelInfo(**doc["model"]), recipe=RecipeInfo(**doc["recipe"]),
                     runtime_profiles=doc["runtime_profiles"], format="gguf",
                     files=[FileEntry(**f) for f in artifact_files], toolchain=doc["toolchain"], build=doc["build"],
                     validation=doc["validation"])
    assert Manifest.parse(reordered, WHERE).to_bytes() == Manifest.parse(doc, WHERE).to_bytes() == built.to_bytes()


def test_total_size_is_the_sum_of_the_files_on_disk(artifact_files, tmp_path):
    m = Manifest.parse(manifest_doc(artifact_files), WHERE)
    assert m.total_size == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert Manifest.parse(manifest_doc([]), WHERE).total_size == 0


@pytest.mark.parametrize("damage,loc", [
    (lambda raw: raw[: len(raw) // 2], "(top level)"),  # truncated in the store
    (lambda raw: b"", "(top level)"),
    (lambda raw: b"[]", "(top level)"),  # JSON, but not an object
    (lambda raw: b"\xff\xfe garbage", "(top level)"),
])
def test_damaged_bytes_are_one_line_naming_where(artifact_files, damage, loc):
    raw = Manifest.parse(manifest_doc(artifact_files), WHERE).to_bytes()
    with pytest.raises(IntegrityError) as err:
        Manifest.parse(damage(raw), WHERE)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{WHERE} is not a valid manifest ({loc}")
    assert message.endswith("the store is damaged")


@pytest.mark.parametrize("edit,loc", [
    (lambda d: d.pop("build_id"), "build_id"),
    (lambda d: d["files"][1].update(size="big"), "files.1.size"),
    (lambda d: d["files"][0].pop("sha256"), "files.0.sha256"),
    # a file entry smuggling a field a reader might act on is refused, not ignored
    (lambda d: d["files"][0].update(executable=True), "files.0.executable"),
    (lambda d: d["model"].update(content_digest=None), "model.content_digest"),
    (lambda d: d.update(files={"path": "x"}), "files"),
])
def test_malformed_documents_name_the_first_bad_field(artifact_files, edit, loc):
    doc = manifest_doc(artifact_files)
    edit(doc)
    for raw in (doc, json.dumps(doc).encode()):  # a decoded store document and stored bytes alike
        with pytest.raises(IntegrityError, match=rf"^{WHERE} is not a valid manifest \({loc}: ") as err:
            Manifest.parse(raw, WHERE)
        assert "\n" not in str(err.value)


def test_pending_needs_says_what_the_build_recorded(artifact_files):
    recorded = Manifest.parse(manifest_doc(artifact_files, build={"needs": "an AI 100 with the Cloud AI SDK"}), WHERE)
    assert recorded.pending_needs == "an AI 100 with the Cloud AI SDK"
    older = Manifest.parse(manifest_doc(artifact_files, build={}), WHERE)  # bundles from before the record
    assert older.pending_needs and older.pending_needs != recorded.pending_needs


def test_manifests_from_before_per_profile_serving_still_describe_their_profile(artifact_files):
    legacy = Manifest.parse(manifest_doc(artifact_files, serving={"engine": "llama.cpp", "model_file": "m.gguf",
                                                                   "n_ctx": 2048}), WHERE)
    assert legacy.serving_for("llm-llamacpp-cpu") == {"engine": "llama.cpp", "model_file": "m.gguf", "n_ctx": 2048}
    legacy.serving_for("llm-llamacpp-cpu")["n_ctx"] = 1  # a caller's copy: the manifest is unchanged
    assert legacy.serving["n_ctx"] == 2048
    current = Manifest.parse(manifest_doc(artifact_files, serving={
        "llm-llamacpp-cpu": {"engine": "llama.cpp", "command": ["llama-server"]}}), WHERE)
    assert current.serving_for("llm-llamacpp-cpu")["command"] == ["llama-server"]
    assert current.serving_for("vllm-cu121") == {}  # another profile's description is never borrowed
    assert Manifest.parse(manifest_doc(artifact_files), WHERE).serving_for("llm-llamacpp-cpu") == {}


# --- build ids ----------------------------------------------------------------------------------------------

FILES = [("model.safetensors", "1" * 64), ("config.json", "2" * 64)]
RECIPE = '{"id":"gguf-f16","kind":"gguf"}'
TOOLCHAIN = {"gguf": "0.19.0", "hive_aot_gguf_format": "1"}


def test_build_id_is_stable_across_releases():
    """Published artifacts are found again by their id: the id of a fixed input is pinned here as the sha256 of
    the document written out by hand (files sorted by path, keys sorted, compact)."""
    written_out = ('{"commit":"c1","files":[["config.json","' + "2" * 64 + '"],["model.safetensors","' + "1" * 64
                   + '"]],"model_id":"org/m","recipe":"{\\"id\\":\\"gguf-f16\\",\\"kind\\":\\"gguf\\"}",'
                   '"toolchain":{"gguf":"0.19.0","hive_aot_gguf_format":"1"}}')
    assert compute_build_id("org/m", "c1", FILES, RECIPE, TOOLCHAIN) == hashlib.sha256(written_out.encode()).hexdigest()
    # a derived recipe adds the build it is made from ("input" sorts between "files" and "model_id")
    derived = written_out.replace(',"model_id"', ',"input":"' + "9" * 64 + '","model_id"')
    assert compute_build_id("org/m", "c1", FILES, RECIPE, TOOLCHAIN, input_build_id="9" * 64) == \
        hashlib.sha256(derived.encode()).hexdigest()


def test_build_id_does_not_depend_on_listing_order():
    a = compute_build_id("org/m", "c1", FILES, RECIPE, TOOLCHAIN)
    assert a == compute_build_id("org/m", "c1", FILES[::-1], RECIPE, dict(reversed(list(TOOLCHAIN.items()))))
    assert len(a) == 64 and int(a, 16) >= 0


@pytest.mark.parametrize("change", [
    dict(model_id="org/other"),
    dict(commit="c2"),
    dict(files=[("model.safetensors", "3" * 64), ("config.json", "2" * 64)]),  # one file's bytes changed
    dict(files=[("weights.safetensors", "1" * 64), ("config.json", "2" * 64)]),  # one file renamed
    dict(files=FILES[:1]),  # one file fewer
    dict(recipe_canonical='{"id":"gguf-f16","kind":"gguf","outtype":"q8_0"}'),
    dict(toolchain={**TOOLCHAIN, "gguf": "0.20.0"}),  # a toolchain version
    dict(toolchain={**TOOLCHAIN, "hive_aot_gguf_format": "2"}),  # the target's own format version
    dict(input_build_id="9" * 64),
])
def test_everything_that_shapes_the_bytes_changes_the_build_id(change):
    base = dict(model_id="org/m", commit="c1", files=FILES, recipe_canonical=RECIPE, toolchain=TOOLCHAIN)
    assert compute_build_id(**{**base, **change}) != compute_build_id(**base)
