"""Operators' commands on a real store: `tag` (promote, roll back), `retire` (takedown; blobs to gc), and gc
reading sizes and ages from the listing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import copy_model, edit_config, write_test_config

from pipelines.cli.main import main
from pipelines.client.inventory import gc, list_published
from pipelines.client.operations import retire, tag
from pipelines.client.pull import pull
from pipelines.config.registry import Config
from pipelines.core.errors import HiveError
from pipelines.engine.build import build_and_publish

REPO = Path.cwd()
MODEL, OTHER = "test-org/ops-llama", "test-org/ops-other"
CPU = "llm-llamacpp-cpu"


@pytest.fixture(scope="module")
def store(tiny_llama, tmp_path_factory):
    """Two builds of gguf-f16 for MODEL (the second one `latest`), and OTHER's build beside them."""
    root = tmp_path_factory.mktemp("ops")
    config = Config.load(write_test_config(root / "cfg", REPO))
    store = root / "store"
    second = copy_model(tiny_llama, root / "second")
    edit_config(second, rms_norm_eps=2e-6)  # other bytes, another build id
    builds = [build_and_publish(str(d), "gguf-f16", config, str(store), MODEL) for d in (tiny_llama, second)]
    other = build_and_publish(str(tiny_llama), "gguf-f16", config, str(store), OTHER)
    assert [b.state for b in builds + [other]] == ["published"] * 3 and builds[0].build_id != builds[1].build_id
    return {"store": store, "first": builds[0], "second": builds[1], "other": other}


def test_tag_promotes_and_rolls_back(store, tmp_path):
    s, first, second = str(store["store"]), store["first"], store["second"]
    assert pull(MODEL, CPU, tmp_path / "a", store_uri=s).build_id == second.build_id
    with pytest.raises(HiveError, match="nothing published with tag 'stable'"):
        pull(MODEL, CPU, tmp_path / "b", tag="stable", store_uri=s)
    res = tag(f"{MODEL}@{first.build_id}", "stable", store_uri=s)
    assert (res["recipe"], res["previous_build_id"]) == ("gguf-f16", None)
    assert pull(MODEL, CPU, tmp_path / "b", tag="stable", store_uri=s).build_id == first.build_id
    # roll latest back to the first build, and forward again
    assert tag(f"{MODEL}@{first.build_id}", "latest", store_uri=s)["previous_build_id"] == second.build_id
    assert pull(MODEL, CPU, tmp_path / "c", store_uri=s).build_id == first.build_id
    tag(f"{MODEL}@{second.build_id}", "latest", store_uri=s)
    assert pull(MODEL, CPU, tmp_path / "d", store_uri=s).build_id == second.build_id


@pytest.mark.parametrize("args,message", [
    (["test-org/ops-llama", "stable"], r"name the build to tag: test-org/ops-llama@<build id>"),
    (["test-org/ops-llama@" + "0" * 64, "stable"], r"no published build 0{64}"),
    (["FIRST", "bundle-latest"], r"a servable artifact: bundle-\* tags are for export bundles"),
    (["FIRST", "no/slashes"], r"'no/slashes' is not a valid tag"),
])
def test_tag_refusals_are_one_line(store, args, message, capsys):
    args = [a.replace("FIRST", f"{MODEL}@{store['first'].build_id}") for a in args]
    capsys.readouterr()
    assert main(["tag", *args, "--store", str(store["store"])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hive-aot: error: ")
    import re

    assert re.search(message, err), err


def test_retire_takes_the_model_off_the_store_and_gc_takes_its_blobs(store, tmp_path, capsys, monkeypatch):
    s = str(tmp_path / "store")
    import shutil

    shutil.copytree(store["store"], s)
    blobs = {f["sha256"] for b in (store["first"], store["second"]) for f in b.files}
    other_blobs = {f["sha256"] for f in store["other"].files}
    preview = retire(MODEL, store_uri=s, dry_run=True)
    assert preview["refs"] and preview["manifests"] and preview["blobs_left_for_gc"] == 2
    capsys.readouterr()
    assert main(["retire", MODEL, "--store", s, "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert len(done["manifests"]) == 2 and not done["dry_run"]
    assert {r["model_id"] for r in list_published(s)} == {OTHER}
    for spec in (MODEL, f"{MODEL}@{store['first'].build_id}"):  # not by tag, not by build id
        with pytest.raises(HiveError, match=f"{MODEL}: nothing published"):
            pull(spec, CPU, tmp_path / "gone", store_uri=s)
    # gc reads sizes and ages from the listing: no request per blob
    from pipelines.store.local import LocalStore

    def no_head(*_a, **_k):
        raise AssertionError("gc asked for one blob's metadata")

    monkeypatch.setattr(LocalStore, "modified", no_head)
    monkeypatch.setattr(LocalStore, "size", no_head)
    res = gc(s, min_age_s=0)
    assert {k.rsplit("/", 1)[-1] for k in res["blobs"]} == blobs and res["bytes"] > 0
    monkeypatch.undo()
    assert pull(OTHER, CPU, tmp_path / "other", store_uri=s).build_id == store["other"].build_id
    assert all((Path(s) / "blobs" / "sha256" / d[:2] / d).is_file() for d in other_blobs)
    with pytest.raises(HiveError, match=f"{MODEL}: nothing published in"):
        retire(MODEL, store_uri=s)


@pytest.mark.parametrize("recipe", ["", ".", "./.", "..", "gguf-f16/..", "GGUF-F16"])
def test_retire_of_a_recipe_that_is_no_recipe_id_retires_nothing(store, recipe, capsys):
    """Red team round two, item 7: `--recipe ''`, '.' or './.' retired every recipe of the model."""
    s = str(store["store"])
    before = sorted(p.relative_to(s).as_posix() for p in Path(s).rglob("*") if p.is_file())
    capsys.readouterr()
    assert main(["retire", MODEL, "--recipe", recipe, "--store", s]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a recipe id" in err, err
    assert sorted(p.relative_to(s).as_posix() for p in Path(s).rglob("*") if p.is_file()) == before


def test_ls_prints_every_tag_whole(store, tmp_path, capsys):
    """Red team round two, item 20: ls cut tags to ten characters (`bundle-la...`, `bundle-lo...`)."""
    import shutil

    s = str(tmp_path / "store")
    shutil.copytree(store["store"], s)
    long_tag = "release-candidate-2026-12-04"
    assert main(["tag", f"{MODEL}@{store['first'].build_id}", long_tag, "--store", s]) == 0
    capsys.readouterr()
    assert main(["ls", "--store", s]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if long_tag in line)
    assert store["first"].build_id[:12] in row and "MiB" in row
