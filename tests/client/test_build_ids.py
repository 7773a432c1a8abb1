"""Build-id prefixes (build_ids.py): the 12-hex id every human output prints, or any unique prefix of at least
8 hex digits, names the one published build of a model wherever a build id is accepted (pull, serve, profiles,
verify, tag, compile, modelcar); too short, not hex, no match and ambiguous are one line each. The resolution
itself on key listings, then the commands on a real local store and pull on the real OCI registry."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from factories import write_test_config

from pipelines.cli.main import main
from pipelines.client.build_ids import check_build_ref, published_builds, resolve_build_id
from pipelines.client.pull import pull
from pipelines.config.registry import Config
from pipelines.core.errors import HiveError
from pipelines.engine.build import build_and_publish
from pipelines.store import open_store

REPO = Path.cwd()
MODEL, SLUG = "test-org/prefixed", "test-org--prefixed"
CPU = "llm-llamacpp-cpu"
A = "5059cc72168f" + "0" * 52
B = "5059cc72" + "f" * 56  # shares A's first 8 digits, not its first 12
C = "ab" * 32


def _keys(*pairs: tuple[str, str]) -> list[str]:
    return [f"manifests/{SLUG}/{recipe}/{build}.json" for recipe, build in pairs]


def _refusal(given: str, keys: list[str], recipe: str | None = None) -> str:
    with pytest.raises(HiveError) as e:
        resolve_build_id(given, keys, model_id=MODEL, where="STORE", recipe=recipe)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_unique_prefix_names_the_full_id_and_a_full_id_stays_as_it_is():
    keys = _keys(("gguf-f16", A), ("gguf-q8_0", C))
    assert resolve_build_id(A[:12], keys, model_id=MODEL, where="S") == A
    assert resolve_build_id(C[:8], keys, model_id=MODEL, where="S") == C
    assert resolve_build_id(A, [], model_id=MODEL, where="S") == A  # whether it exists is the caller's to say
    # the same build id under two recipes is one build id: the prefix resolves; which recipe is the caller's
    both = _keys(("gguf-f16", C), ("gguf-q8_0", C))
    assert resolve_build_id(C[:10], both, model_id=MODEL, where="S") == C
    assert published_builds(both) == {C: ["gguf-f16", "gguf-q8_0"]}
    # keys of any other shape are not builds
    assert published_builds([f"manifests/{SLUG}/gguf-f16/{A[:12]}.json", f"manifests/{SLUG}/gguf-f16/x/{A}.json",
                             f"manifests/{SLUG}/gguf-f16/{A}.sig"]) == {}


def test_an_ambiguous_prefix_lists_the_candidates_and_a_recipe_settles_it():
    keys = _keys(("gguf-f16", A), ("gguf-q8_0", B), ("gguf-q8_0", C))
    msg = _refusal("5059cc72", keys)
    assert msg == (f"{MODEL}: build 5059cc72 is ambiguous, 2 published builds start with it: {A} (gguf-f16), "
                   f"{B} (gguf-q8_0); give more of its digits or --recipe")
    assert resolve_build_id("5059cc72", keys, model_id=MODEL, where="S", recipe="gguf-q8_0") == B
    assert resolve_build_id("5059cc721", keys, model_id=MODEL, where="S") == A  # one more digit is unique
    # candidates of one recipe: --recipe would not help, so it is not offered
    same = _keys(("gguf-f16", A), ("gguf-f16", B))
    assert _refusal("5059cc72", same).endswith("; give more of its digits")


def test_no_match_names_what_is_published():
    keys = _keys(("gguf-f16", A), ("gguf-q8_0", C))
    assert _refusal("deadbeef", keys) == (f"{MODEL}: no published build starts with deadbeef in STORE "
                                          f"(published: {A[:12]} (gguf-f16), {C[:12]} (gguf-q8_0))")
    assert _refusal(C[:8], keys, recipe="gguf-f16").startswith(f"{MODEL}: no published build of gguf-f16 starts with")
    assert _refusal("deadbeef", []).endswith("(published: none)")
    many = _keys(*[("gguf-f16", f"{i:02x}" * 32) for i in range(11)])
    assert _refusal("deadbeef", many).endswith(" and 3 more (hive-aot ls))")


@pytest.mark.parametrize("given,needle", [
    ("5059cc7", "'5059cc7' is too short for a build id: give at least 8 of its hex digits"),
    ("", "'' is not a build id (lowercase hex digits: all 64, or a unique prefix of at least 8)"),
    ("5059CC72168F", "'5059CC72168F' is not a build id"),
    ("5059cc72168g", "'5059cc72168g' is not a build id"),
    ("../../x", "'../../x' is not a build id"),
    (A + "0", "is not a build id"),  # 65 digits
])
def test_too_short_or_not_hex_is_one_line(given, needle):
    with pytest.raises(HiveError, match=re.escape(needle)):
        check_build_ref(given)


@pytest.fixture(scope="module")
def published(tiny_llama, tmp_path_factory):
    """The tiny model's gguf-f16 build in a local store."""
    root = tmp_path_factory.mktemp("prefixes")
    registry = write_test_config(root / "cfg", REPO)
    res = build_and_publish(str(tiny_llama), "gguf-f16", Config.load(registry), str(root / "store"), MODEL)
    assert res.state == "published"
    return {"store": root / "store", "build": res.build_id, "registry": registry}


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_pull_and_tag_take_the_printed_12_hex_id(published, capsys, tmp_path):
    store, build = str(published["store"]), published["build"]
    rc, out, err = _cli(capsys, "pull", f"{MODEL}@{build[:12]}", "--target", CPU, "--dest", str(tmp_path / "m"),
                        "--store", store, "--json")
    assert rc == 0, err
    assert json.loads(out)["build_id"] == build and (tmp_path / "m").is_dir()
    rc, out, err = _cli(capsys, "tag", f"{MODEL}@{build[:12]}", "stable", "--store", store)
    assert rc == 0, err
    assert out.strip() == f"{MODEL} gguf-f16 stable -> build {build[:12]}"
    ref = json.loads((published["store"] / f"refs/{SLUG}/gguf-f16/stable").read_text())
    assert ref["build_id"] == build  # the ref names the full id, never the prefix
    assert pull(MODEL, CPU, tmp_path / "s", tag="stable", store_uri=store).build_id == build
    # profiles, verify and serve (a dry run) take the shortest prefix too
    for args in (["profiles", f"{MODEL}@{build[:8]}"], ["verify", f"{MODEL}@{build[:8]}"],
                 ["serve", f"{MODEL}@{build[:8]}", "--target", CPU, "--dest", str(tmp_path / "v"), "--dry-run"]):
        rc, out, err = _cli(capsys, *args, "--store", store, "--json")
        assert rc == 0, (args, err)
        assert build in out, args


def _other(build: str, keep: int) -> str:
    """A build id sharing the first `keep` digits of `build`, and no more."""
    return build[:keep] + ("1" if build[keep] == "0" else "0") + build[keep + 1:]


def _error(capsys, *args: str) -> str:
    rc, out, err = _cli(capsys, *args)
    assert rc == 1 and err.count("\n") == 1 and err.startswith("hive-aot: error: "), (args, out, err)
    return err.strip().removeprefix("hive-aot: error: ")


def test_refusals_are_one_line_naming_what_is_published(published, capsys, tmp_path):
    store, build = str(published["store"]), published["build"]
    dest = tmp_path / "d"
    assert "is too short for a build id" in _error(capsys, "pull", f"{MODEL}@{build[:7]}", "--target", CPU,
                                                   "--dest", str(dest), "--store", store)
    missing = _other(build, 0)[:8]
    for args in (["pull", f"{MODEL}@{missing}", "--target", CPU, "--dest", str(dest)],
                 ["tag", f"{MODEL}@{missing}", "stable"],
                 ["compile", f"{MODEL}@{missing}", "--registry", str(published["registry"])]):
        assert _error(capsys, *args, "--store", store) == (
            f"{MODEL}: no published build starts with {missing} in {open_store(store).uri} "
            f"(published: {build[:12]} (gguf-f16))"), args
    assert not dest.exists()


def test_an_ambiguous_prefix_is_one_line_and_recipe_settles_it(published, capsys, tmp_path):
    """A second manifest key whose id shares the printed 12 digits: the resolution reads keys only, so the
    refusal comes before any manifest is read (this one's content is another build's, never loaded)."""
    store = tmp_path / "store"
    shutil.copytree(published["store"], store)
    build = published["build"]
    twin = _other(build, 12)
    src = store / f"manifests/{SLUG}/gguf-f16/{build}.json"
    (store / f"manifests/{SLUG}/gguf-q8_0").mkdir(parents=True)
    shutil.copy(src, store / f"manifests/{SLUG}/gguf-q8_0/{twin}.json")
    candidates = f"{build} (gguf-f16), {twin} (gguf-q8_0)" if build < twin else f"{twin} (gguf-q8_0), {build} (gguf-f16)"
    expected = (f"{MODEL}: build {build[:12]} is ambiguous, 2 published builds start with it: {candidates}; give "
                f"more of its digits or --recipe")
    for args in (["pull", f"{MODEL}@{build[:12]}", "--target", CPU, "--dest", str(tmp_path / "d")],
                 ["tag", f"{MODEL}@{build[:12]}", "canary"], ["verify", f"{MODEL}@{build[:12]}"],
                 ["profiles", f"{MODEL}@{build[:12]}"]):
        assert _error(capsys, *args, "--store", str(store)) == expected, args
    assert not (tmp_path / "d").exists() and not (store / f"refs/{SLUG}/gguf-f16/canary").exists()
    # the recipe settles it, and one more digit does
    res = pull(f"{MODEL}@{build[:12]}", CPU, tmp_path / "r", recipe="gguf-f16", store_uri=str(store))
    assert res.build_id == build
    rc, out, err = _cli(capsys, "tag", f"{MODEL}@{build[:12]}", "canary", "--recipe", "gguf-f16", "--store", str(store))
    assert rc == 0 and json.loads((store / f"refs/{SLUG}/gguf-f16/canary").read_text())["build_id"] == build, err
    rc, out, err = _cli(capsys, "verify", f"{MODEL}@{build[:13]}", "--store", str(store), "--json")
    assert rc == 0 and [b["build_id"] for b in json.loads(out)["builds"]] == [build], err


def test_prefixes_on_the_real_oci_registry(oci_uri, published, capsys, tmp_path, tiny_llama):
    """On OCI the listing is the model repository's tags: pull, tag and modelcar --build take the 12-hex id."""
    build = build_and_publish(str(tiny_llama), "gguf-f16", Config.load(published["registry"]), oci_uri, MODEL)
    assert build.state == "published" and build.build_id == published["build"]  # a build id is content, not place
    full = build.build_id
    res = pull(f"{MODEL}@{full[:12]}", CPU, tmp_path / "m", store_uri=oci_uri)
    assert res.build_id == full and res.recipe == "gguf-f16"
    rc, out, err = _cli(capsys, "tag", f"{MODEL}@{full[:12]}", "stable", "--store", oci_uri)
    assert rc == 0 and out.strip().endswith(f"stable -> build {full[:12]}"), err
    assert pull(MODEL, CPU, tmp_path / "s", tag="stable", store_uri=oci_uri).build_id == full
    rc, out, err = _cli(capsys, "modelcar", MODEL, "--build", full[:12], "--store", oci_uri, "--json")
    assert rc == 0, err
    assert json.loads(out)["tag"] == f"gguf-f16.{full}-modelcar"  # the image is named by the full id
    missing = _other(full, 0)[:8]
    assert _error(capsys, "modelcar", MODEL, "--build", missing, "--store", oci_uri) == (
        f"{MODEL}: no published build starts with {missing} in {oci_uri} (published: {full[:12]} (gguf-f16))")
