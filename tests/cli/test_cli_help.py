"""`hive-aot`'s help and `--version`: every option of every command says what it does and shows its default,
`--target` names the runtime profiles, and `--version` reports the engines and llama.cpp's CPU level, in the
full environment and in one with no engine at all."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from pipelines.cli.main import main, parser

REPO = Path.cwd()


def _parsers(p: argparse.ArgumentParser, path: tuple[str, ...] = ("hive-aot",)):
    """(command path, parser) for the whole tree: hive-aot, each command, each registry subcommand."""
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                yield from _parsers(sp, (*path, name))


def _shows_a_default(action: argparse.Action) -> bool:
    return action.default is not None and action.default is not False and action.default is not argparse.SUPPRESS


def test_every_option_of_every_command_has_help_and_shows_its_default():
    undocumented, hidden_defaults, with_default = [], [], 0
    for path, p in _parsers(parser()):
        formatter = p._get_formatter()
        page = " ".join(p.format_help().split())
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = " ".join(path) + " " + ("/".join(action.option_strings) or str(action.metavar or action.dest))
            if isinstance(action, argparse._SubParsersAction):  # its commands each need their line too
                undocumented += [f"{name} {c.dest}" for c in action._choices_actions if not c.help]
            if not action.help:
                undocumented.append(name)
                continue
            if _shows_a_default(action):
                with_default += 1
                text = " ".join(formatter._expand_help(action).split())
                if f"(default: {action.default})" not in text or text not in page:
                    hidden_defaults.append(f"{name}: {text}")
    assert undocumented == []
    assert hidden_defaults == []
    assert with_default >= 10  # --tag (five commands), --min-age, --hardware, --target auto, sync's versions


def test_min_age_shows_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["gc", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--min-age SECONDS" in out and "(default: 3600.0)" in out


@pytest.mark.parametrize("command", ["pull", "serve"])
def test_target_names_every_runtime_profile(command, capsys, monkeypatch, tmp_path):
    from pipelines.config.registry import load_registry

    profiles = [p.id for p in load_registry()[0].runtime_profiles]
    assert "llm-llamacpp-cpu" in profiles and len(profiles) > 5
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert all(f" {p}," in out or f" {p}\n" in out or f" {p} " in out for p in profiles), out
    # a deployment registry adds its own; a broken one still leaves --help working, with the packaged profiles
    own = tmp_path / "registry.yaml"
    own.write_text("runtime_profiles:\n  - {id: acme-npu, vendor: cpu, role: gguf, framework: acme, image: acme/npu, "
                   "active: false, loads: [gguf]}\n")
    monkeypatch.setenv("HIVE_AOT_REGISTRY", str(own))
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "acme-npu" in capsys.readouterr().out
    own.write_text("runtime_profiles: [")
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "llm-llamacpp-cpu" in out and "acme-npu" not in out


def _installed_level() -> str:
    return os.environ.get("HIVE_AOT_LLAMA_CPU_LEVEL") or subprocess.run(
        [str(REPO / "requirements" / "llama-cpp" / "level.sh")], capture_output=True, text=True, check=True).stdout.strip()


def _hive(*args: str, python: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(python or [sys.executable]), "-m", "pipelines.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_version_names_the_package_the_engines_and_the_llama_cpp_cpu_level():
    proc = _hive("--version", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["hive_aot"] == metadata.version("hive-aot")
    for engine, version in doc["engines"].items():
        try:
            assert version == metadata.version(engine)
        except metadata.PackageNotFoundError:
            assert version == "not installed"
    assert set(doc["engines"]) == {"llama-cpp-python", "transformers", "torch", "vllm"}
    assert doc["engines"]["llama-cpp-python"] == metadata.version("llama-cpp-python")  # this venv has it
    cpu = doc["llama_cpp_cpu_level"]
    assert cpu["level"] == _installed_level() and "libggml-cpu" in cpu["source"], cpu
    # the human form: a table with its header, then the level in words
    human = _hive("--version")
    assert human.returncode == 0 and human.stderr == ""
    lines = human.stdout.splitlines()
    assert lines[0] == f"hive-aot {doc['hive_aot']} (Python {doc['python']})"
    assert lines[1].split() == ["engine", "version", "where"]
    assert lines[-1] == f"llama.cpp CPU level: {cpu['level']} ({cpu['source']})"
    assert _hive("--version", "--no-such-flag").returncode == 2


def test_version_without_any_engine_says_not_installed():
    """No site-packages at all (lighter than the base install): every engine is "not installed", nothing fails."""
    proc = _hive("--version", "--json", python=[sys.executable, "-S"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc["engines"].values()) == {"not installed"}
    assert doc["vllm_validation"] is None and doc["llama_cpp_cpu_level"]["level"] is None
    import pipelines

    assert doc["hive_aot"] == pipelines.__version__ == metadata.version("hive-aot")


def test_ls_groups_the_tags_of_a_build():
    from pipelines.client.inventory import published_builds

    row = {"model_id": "o/m", "recipe": "gguf-f16", "size": 5, "manifest": "k"}
    rows = [{**row, "tag": "latest", "build_id": "a" * 64, "created_at": "2026-01-02T00:00:00+00:00"},
            {**row, "tag": "stable", "build_id": "a" * 64, "created_at": "2026-01-01T00:00:00+00:00"},
            {**row, "tag": "old", "build_id": "b" * 64, "created_at": "2025-12-01T00:00:00+00:00"}]
    builds = published_builds(rows)
    assert [(b["build_id"][0], b["tags"], b["created_at"][:10]) for b in builds] == [
        ("a", ["latest", "stable"], "2026-01-01"), ("b", ["old"], "2025-12-01")]
