"""`hive-aot` as a subprocess: one JSON document with --json, one error line, documented exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from factories import GGUF_RECIPES, copy_model, edit_config, poison_weights, write_test_config

REPO = Path.cwd()
MODEL = "test-org/tiny-llama"
SLUG = "test-org--tiny-llama"
VLLM_RECIPES = ["vllm-bf16", "vllm-fp8", "vllm-w4a16", "vllm-w8a8-int8"]  # what a vLLM profile loads of a dense Llama


def hive(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def doc(proc: subprocess.CompletedProcess):
    """The whole of stdout must be exactly one JSON document."""
    return json.loads(proc.stdout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line; a build's step lines (`hive-aot: [convert] start`, progress.py) may come before it."""
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("hive-aot: [")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hive-aot: error: "), proc.stderr
    return lines[0]


def _blobs(store: Path) -> set[str]:
    return {str(p.relative_to(store)) for p in (store / "blobs").rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-models")
    nan = copy_model(tiny_llama, root / "nan")
    poison_weights(nan)
    remote = copy_model(tiny_llama, root / "remote")
    edit_config(remote, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    noarch = copy_model(tiny_llama, root / "noarch")
    edit_config(noarch, architectures=None)
    return {"good": tiny_llama, "nan": nan, "remote": remote, "noarch": noarch}


@pytest.fixture(scope="module")
def built(models, tmp_path_factory):
    """Through the CLI: publish f16, build it again, and a q4_k_m that validation rejects under strict
    gates (NaN weights no longer get that far: conversion refuses them)."""
    root = tmp_path_factory.mktemp("cli")
    store = root / "store"
    reg = str(write_test_config(root / "cfg", REPO))  # test gates for random-weight models
    strict = str(write_test_config(root / "strict", REPO, gates={
        "gguf-q4_k_m": {"min_top1_agreement": 0.999, "max_mean_kl": 1e-6, "require_token_parity": True}}))
    common = ("--recipe", "gguf-f16", "--store", str(store), "--registry", reg, "--json")
    first = hive("build", str(models["good"]), "--model-id", MODEL, *common)
    again = hive("build", str(models["good"]), "--model-id", MODEL, *common)
    rejected = hive("build", str(models["good"]), "--model-id", "test-org/strict", "--recipe", "gguf-q4_k_m",
                    "--store", str(store), "--registry", strict, "--json")
    return {"store": store, "registry": reg, "first": first, "again": again, "rejected": rejected}


def test_build_json_published_then_skipped(built):
    first = built["first"]
    assert first.returncode == 0, first.stderr
    d = doc(first)
    assert d["state"] == "published" and d["skipped"] is False
    assert isinstance(d["manifest"], str) and d["manifest"] == (
        f"{built['store'].as_uri()}/manifests/{SLUG}/gguf-f16/{d['build_id']}.json")
    assert d["validation"]["passed"] is True and d["validation"]["metrics"]["finite"] is True
    assert d["validation"]["metrics"]["token_parity"] == 1.0
    assert (built["store"] / f"manifests/{SLUG}/gguf-f16/{d['build_id']}.json").is_file()

    again = built["again"]
    assert again.returncode == 0, again.stderr
    a = doc(again)
    assert a["state"] == "skipped" and a["skipped"] is True and a["build_id"] == d["build_id"]
    assert a["manifest"] == d["manifest"]


def test_build_rejected_exits_3(built):
    rej = built["rejected"]
    assert rej.returncode == 3, rej.stderr
    d = doc(rej)
    assert d["state"] == "rejected" and d["skipped"] is False and d["manifest"] == ""
    assert d["validation"]["passed"] is False and d["validation"]["metrics"]["finite"] is True
    assert "hive-aot: validation failed: " in rej.stderr and "mean KL" in rej.stderr
    assert not (built["store"] / "manifests" / "test-org--strict").exists()
    assert not (built["store"] / "refs" / "test-org--strict").exists()
    assert list((built["store"] / "staging").iterdir()) == []


def test_build_human_output(built, models):
    proc = hive("build", str(models["good"]), "--recipe", "gguf-f16", "--model-id", MODEL, "--store", str(built["store"]),
                "--registry", built["registry"])
    assert proc.returncode == 0, proc.stderr
    bid = doc(built["first"])["build_id"]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"skipped gguf-f16 for {MODEL}: build {bid[:12]}, ")
    assert re.search(r", top-1 [01]\.\d{4}, KL \d\.\d{5}$", lines[0]), lines[0]
    assert lines[1].strip() == doc(built["first"])["manifest"]


def test_build_bad_input_exits_1_with_one_line(models, tmp_path):
    store = tmp_path / "store"
    proc = hive("build", str(models["good"]), "--recipe", "gguf-q1", "--model-id", MODEL, "--store", str(store))
    assert proc.returncode == 1 and proc.stdout == ""
    assert "unknown recipe 'gguf-q1'" in one_error_line(proc)

    proc = hive("build", str(models["remote"]), "--recipe", "gguf-f16", "--model-id", "test-org/remote",
                "--store", str(store), "--json")
    assert proc.returncode == 1
    assert "requires review" in one_error_line(proc)
    d = doc(proc)
    assert d["exit_code"] == 1 and "requires review" in d["error"]

    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = hive("build", str(models["good"]), "--recipe", "gguf-f16", "--model-id", MODEL, "--store", str(blocker / "s"))
    assert proc.returncode == 1 and "is not writable" in one_error_line(proc)

    proc = hive("build", str(tmp_path / "no-such-dir"), "--recipe", "gguf-f16", "--store", str(store))
    assert proc.returncode == 1 and "no-such-dir: not a directory" in one_error_line(proc)
    assert not (store / "manifests").exists() and not (store / "refs").exists()


def test_usage_errors_exit_2(tmp_path):
    for args in (["build", "somewhere"], ["frobnicate"], [], ["pull", MODEL, "--dest", "x"], ["gc", "--min-age", "soon"]):
        proc = hive(*args, cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stdout == "" and "usage: hive-aot" in proc.stderr


def test_check_exit_codes(models):
    ok = hive("check", str(models["good"]), "--model-id", MODEL, "--json")
    assert ok.returncode == 0, ok.stderr
    d = doc(ok)
    assert d["status"] == "compatible" and d["runtime_profile_id"] == "vllm-cu121" and d["model_id"] == MODEL
    assert d["revision"].startswith("local-") and d["estimated_requirements"]["parameters"] > 0
    assert sorted(d["recipes"]) == VLLM_RECIPES  # what vllm-cu121 loads

    cpu = hive("check", str(models["good"]), "--model-id", MODEL, "--hardware", "cpu", "--json")
    assert cpu.returncode == 0 and doc(cpu)["runtime_profile_id"] == "llm-llamacpp-cpu"
    assert sorted(doc(cpu)["recipes"]) == GGUF_RECIPES
    # every hardware docs/compatibility.md names lists only what its routed profile loads
    for hw, profile, recipes in (("amd-mi300x", "vllm-rocm", VLLM_RECIPES),
                                 ("intel-max-1550", "vllm-xpu", VLLM_RECIPES),
                                 ("nvidia-t4", "vllm-cu121", VLLM_RECIPES),
                                 ("qaic-ai100", "vllm-qaic", ["qaic-export", "qaic-fp16", "qaic-mxfp6"])):
        other = doc(hive("check", str(models["good"]), "--model-id", MODEL, "--hardware", hw, "--json"))
        assert (other["runtime_profile_id"], sorted(other["recipes"])) == (profile, recipes), hw

    review = hive("check", str(models["remote"]), "--json")
    assert review.returncode == 4 and doc(review)["status"] == "requires_review"

    bad = hive("check", str(models["noarch"]), "--json")
    assert bad.returncode == 5 and doc(bad)["status"] == "incompatible" and doc(bad)["runtime_profile_id"] is None

    human = hive("check", str(models["noarch"]))
    assert human.returncode == 5
    assert "incompatible -> none" in human.stdout and "[fail] architecture_known" in human.stdout

    err = hive("check", str(models["good"]), "--hardware", "tpu")
    assert err.returncode == 1 and "unknown hardware 'tpu'" in one_error_line(err)


def test_pull_json_and_errors(built, tmp_path):
    store = str(built["store"])
    dest = tmp_path / "model"
    first = hive("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", store, "--json")
    assert first.returncode == 0, first.stderr
    d = doc(first)
    assert d["already_present"] is False and d["recipe"] == "gguf-f16" and d["dest"] == str(dest)
    assert d["build_id"] == doc(built["first"])["build_id"]
    assert (dest / "hive-aot.json").is_file() and Path(d["files"][0]).is_file()

    again = hive("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", store, "--json")
    assert again.returncode == 0 and doc(again)["already_present"] is True

    human = hive("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", store)
    assert human.returncode == 0 and human.stdout.startswith(f"already present {MODEL} gguf-f16")
    assert "serve: llama-server -m " in human.stdout

    for args, fragment in (
        (["--target", "tpu-v5"], "unknown runtime profile 'tpu-v5'"),
        (["--target", "vllm-cu121"], "no published artifact serves vllm-cu121"),
        (["--target", "llm-llamacpp-cpu", "--recipe", "gguf-q8_0"], "no published gguf-q8_0 artifact"),
    ):
        proc = hive("pull", MODEL, *args, "--dest", str(tmp_path / "x"), "--store", store)
        assert proc.returncode == 1 and fragment in one_error_line(proc), proc.stderr
    proc = hive("pull", "test-org/strict", "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "x"), "--store", store,
                "--json")
    assert proc.returncode == 1 and "nothing published" in one_error_line(proc)
    assert doc(proc)["exit_code"] == 1
    assert not (tmp_path / "x").exists()


def test_ls(built, tmp_path):
    proc = hive("ls", "--store", str(built["store"]), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = doc(proc)
    bid = doc(built["first"])["build_id"]
    assert [(r["model_id"], r["recipe"], r["build_id"]) for r in rows] == [(MODEL, "gguf-f16", bid)] * 2
    assert rows[0]["tag"] == "latest" and re.fullmatch(r"local-[0-9a-f]{64}", rows[1]["tag"])  # --json: ids whole
    assert rows[0]["size"] == doc(built["first"])["files"][0]["size"]
    human = hive("ls", "--store", str(built["store"]))
    assert human.returncode == 0, human.stderr
    # one row per build under a header, its tags joined, long ids cut to 12 hex digits: it fits a terminal
    header, *body = human.stdout.splitlines()
    assert header.split() == ["model", "recipe", "build", "tags", "size", "created", "(UTC)"]
    assert len(body) == 1 and body[0].split()[:5] == [MODEL, "gguf-f16", bid[:12], "latest,", rows[1]["tag"][:18]]
    assert not re.search(r"[0-9a-f]{13,}", human.stdout) and max(map(len, human.stdout.splitlines())) <= 120
    (tmp_path / "empty").mkdir()
    empty = hive("ls", "--store", str(tmp_path / "empty"), "--json")
    assert empty.returncode == 0 and doc(empty) == []


def test_serve_dry_run_needs_no_dest(built, capsys):
    """It downloads nothing, so it needs no directory; without --dry-run, --dest is a usage error (exit 2)."""
    from pipelines.cli.main import main

    common = [MODEL, "--target", "llm-llamacpp-cpu", "--store", str(built["store"])]
    assert main(["serve", *common, "--dry-run", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["dest"] == "/DEST" and d["dest_placeholder"] is True and d["files"][0].startswith("/DEST/")
    assert d["exec"][:3] == ["llama-server", "-m", d["files"][0]]
    assert main(["serve", *common, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would exec: ") and "(no --dest: /DEST stands for the directory it would pull into)" in out
    assert not Path("/DEST").exists()
    with pytest.raises(SystemExit) as e:
        main(["serve", *common])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hive-aot serve: error: the following arguments are required: --dest (only --dry-run, which downloads nothing, "
        "goes without it)")


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_missing_store_is_an_error_not_an_empty_store(command, tmp_path):
    proc = hive(command, "--store", str(tmp_path / "does" / "not" / "exist"))
    assert proc.returncode == 1
    assert one_error_line(proc) == (f"hive-aot: error: store {tmp_path / 'does' / 'not' / 'exist'} does not exist "
                                    "(check --store or $HIVE_AOT_STORE)")
    assert not (tmp_path / "does").exists()


def test_output_into_a_closed_pipe_ends_quietly(built):
    """`hive-aot ls | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (["ls", "--store", str(built["store"])], ["registry", "architectures"]):
        cmd = " ".join([sys.executable, "-m", "pipelines.cli", *args]) + " | head -1"
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=REPO, capture_output=True, text=True,
                              env=env, timeout=120)
        assert len(proc.stdout.splitlines()) == 1
        assert proc.stderr == "", proc.stderr
        assert proc.returncode in (0, 141)  # 141 = 128 + SIGPIPE, as other Unix tools report it


def test_gc_collects_rejected_blobs_only(built, models, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(built["store"], store)
    live = {f"blobs/sha256/{f['sha256'][:2]}/{f['sha256']}" for f in doc(built["first"])["files"]}
    dead = {f"blobs/sha256/{f['sha256'][:2]}/{f['sha256']}" for f in doc(built["rejected"])["files"]}
    assert live and dead and not live & dead
    assert _blobs(store) == live | dead

    young = hive("gc", "--store", str(store), "--json")  # default min-age: fresh blobs may belong to a build in flight
    assert young.returncode == 0 and doc(young)["blobs"] == [] and _blobs(store) == live | dead

    dry = hive("gc", "--store", str(store), "--min-age", "0", "--dry-run", "--json")
    assert dry.returncode == 0 and doc(dry)["dry_run"] is True and set(doc(dry)["blobs"]) == dead
    assert _blobs(store) == live | dead

    proc = hive("gc", "--store", str(store), "--min-age", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    d = doc(proc)
    assert d["dry_run"] is False and set(d["blobs"]) == dead and d["bytes"] > 0 and d["staging"] == []
    assert _blobs(store) == live
    # what is published still pulls
    pulled = hive("pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(tmp_path / "m"), "--store", str(store),
                  "--json", env={"HIVE_AOT_CACHE": str(tmp_path / "cache")})
    assert pulled.returncode == 0 and doc(pulled)["already_present"] is False


def test_every_command_says_what_it_does_in_its_help(capsys):
    """Red team round two, item 20: `onboard --help` (and every other command's) printed only usage and options."""
    from pipelines.cli.main import main, parser

    sub = next(a for a in parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in sub.choices:
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        body = text.split("\n\n")[1] if "\n\n" in text else ""
        assert body.strip() and not body.lstrip().startswith(("positional arguments", "options")), (name, text)
