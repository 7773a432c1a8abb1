"""pipelines/core/settings.py is the one place a HIVE_AOT_* variable is read, and docs/settings.md's table is its list."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

from pipelines.cli import main as cli
from pipelines.core import paths, settings
from pipelines.core.errors import ConfigError
from pipelines.store import default_store_uri, signing

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipelines"
NAME = re.compile(r"HIVE_AOT_[A-Z0-9_]+")
# Other tools' variables hive-aot reads: declared in settings.py too (audience "others"), read only through it.
OTHERS = {name for s in settings.ALL if s.audience == settings.OTHERS for name in (s.name, *s.also)}


def _constant_names(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "HIVE_AOT_..." (and tuple) assignments: the names a read may go through."""
    found: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                     else [(target, node.value)])
            for name, value in pairs:
                if isinstance(name, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found[name.id] = value.value
    return found


def environment_reads(source: str) -> list[str]:
    """The HIVE_AOT_* names (and other tools' declared ones) a module's source reads from os.environ / os.getenv
    (directly or through a module-level constant), as `line: NAME`."""
    tree = ast.parse(source)
    constants = _constant_names(tree)

    def resolve(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    def is_environ(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == "environ")
                or (isinstance(node, ast.Name) and node.id == "environ"))

    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop") and is_environ(func.value):
                key = resolve(node.args[0])
            elif ((isinstance(func, ast.Attribute) and func.attr == "getenv")
                  or (isinstance(func, ast.Name) and func.id == "getenv")):
                key = resolve(node.args[0])
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = resolve(node.slice)
        if key and (key.startswith("HIVE_AOT_") or key in OTHERS):
            reads.append(f"{node.lineno}: {key}")
    return reads


# The vLLM runner runs in the vLLM venv, where hive-aot cannot be imported: it reads the vLLM variable that
# engine.py set for it through settings.
OUTSIDE_THE_PACKAGE = {PACKAGE / "targets" / "vllm" / "runner.py"}


def _modules():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "settings.py" and p not in OUTSIDE_THE_PACKAGE]


def test_the_read_detector_finds_every_form_of_read():
    source = '''
import os
from os import environ, getenv
KEY = "HIVE_AOT_STORE"
A, B = "HIVE_AOT_CACHE", "HIVE_AOT_FAULT"
os.environ.get("HIVE_AOT_REGISTRY")
os.environ[KEY]
environ.get(B, "")
os.getenv("HIVE_AOT_WARM_DIR")
getenv(A)
os.environ.setdefault("HIVE_AOT_RECIPES", "x")
os.environ["HIVE_AOT_FAULT"] = "written, not read"
os.environ.get("PATH")
os.environ.get("https_proxy")
os.environ["DAGSTER_HOME"] = "written, not read"
'''
    assert [r.split(": ")[1] for r in environment_reads(source)] == [
        "HIVE_AOT_REGISTRY", "HIVE_AOT_STORE", "HIVE_AOT_FAULT", "HIVE_AOT_WARM_DIR", "HIVE_AOT_CACHE", "HIVE_AOT_RECIPES",
        "https_proxy"]


def test_no_module_but_settings_reads_a_declared_variable():
    reads = {str(p.relative_to(ROOT)): r for p in _modules() if (r := environment_reads(p.read_text()))}
    assert reads == {}, f"read these through pipelines.core.settings instead: {reads}"


def test_every_hive_aot_name_the_package_spells_out_is_declared():
    """A name written in full anywhere in the code (warm.py's, which runs as a script and cannot import settings;
    messages; docstrings) is a declared setting: a misspelt or undeclared variable fails here."""
    declared = {s.name for s in settings.ALL}
    serving_image = {"HIVE_AOT_MODEL"}  # the serving image's entrypoint variable, named in serve's messages
    spelled = {name for p in _modules() for name in NAME.findall(p.read_text())}
    assert spelled - declared - serving_image == set()
    assert len(declared) == len(settings.ALL), "a name declared twice"


def test_settings_is_a_stdlib_leaf():
    """settings.py imports the standard library and, of the project, only errors.py, which imports the standard
    library alone: any process (the pull client, a warm engine's client) reads its settings cheaply."""
    for module, project_imports in (("settings.py", {"errors"}), ("errors.py", set())):
        tree = ast.parse((PACKAGE / "core" / module).read_text())
        relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
        assert relative == project_imports, (module, relative)
        imported = {(n.module or "" if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                    for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0)
                    for a in (n.names if isinstance(n, ast.Import) else [None])}
        assert imported <= set(sys.stdlib_module_names) | {"__future__"}, (module, imported)


def test_the_docs_table_is_the_declared_list():
    section = (ROOT / "docs" / "settings.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| `")]
    table = {r[0].strip("`"): (r[1].strip("`") if r[1] != "-" else None, r[2]) for r in rows}
    assert table == {s.name: (s.default, s.audience) for s in settings.ALL}


def test_values_are_read_when_asked_and_empty_means_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path))
    assert paths.cache_root() == tmp_path  # set after every import: still seen
    monkeypatch.setenv("HIVE_AOT_STORE", "")
    assert default_store_uri() == "./artifacts"
    monkeypatch.setenv("HIVE_AOT_STORE", "  s3://bucket/prefix ")
    assert default_store_uri() == "s3://bucket/prefix"
    monkeypatch.setenv("HIVE_AOT_SERVE_ENV", " A, ,B ,")
    assert settings.SERVE_ENV.items() == ["A", "B"]


def test_trusted_keys_that_name_nothing_still_fail_closed(monkeypatch):
    """Blank is "named, but nothing": refused, not read as "verify nothing" (only an absent/empty variable is off)."""
    monkeypatch.setenv("HIVE_AOT_TRUSTED_KEYS", " , ")
    with pytest.raises(ConfigError, match="names no public key file"):
        signing.trusted_keys()
    monkeypatch.setenv("HIVE_AOT_TRUSTED_KEYS", "")
    assert signing.trusted_keys() == {}


def test_the_cli_lists_every_setting_and_masks_credentials(monkeypatch, capsys):
    secret = "redis://:hunter2-secret@broker:6379/0"
    monkeypatch.setenv("HIVE_AOT_CELERY_BROKER", secret)
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", "12G")
    monkeypatch.delenv("HIVE_AOT_WARM_IDLE", raising=False)
    assert cli.main(["settings", "--json"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == {s.name for s in settings.ALL}
    assert rows["HIVE_AOT_CELERY_BROKER"]["value"] == "(set)" and rows["HIVE_AOT_CELERY_BROKER"]["set"] is True
    assert rows["HIVE_AOT_MEMORY_BUDGET"]["value"] == "12G"
    assert rows["HIVE_AOT_WARM_IDLE"] == {**rows["HIVE_AOT_WARM_IDLE"], "value": "600", "set": False}
    assert cli.main(["settings"]) == 0
    human = capsys.readouterr().out
    assert "hunter2" not in human and len(human.splitlines()) == len(settings.ALL) + 1  # the header


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "1e999"])
def test_a_timeout_that_is_not_a_positive_number_is_one_line_naming_it(value, monkeypatch):
    from pipelines.core.settings import QAIC_COMPILE_TIMEOUT, SettingError

    monkeypatch.setenv(QAIC_COMPILE_TIMEOUT.name, value)
    with pytest.raises(SettingError) as e:
        QAIC_COMPILE_TIMEOUT.seconds()
    assert str(e.value) == f"HIVE_AOT_QAIC_COMPILE_TIMEOUT={value!r}: expected a positive number of seconds"
    assert e.value.exit_code == 2


def test_a_timeout_reads_seconds_and_falls_back_to_its_default(monkeypatch):
    from pipelines.core.settings import VLLM_TIMEOUT

    monkeypatch.setenv(VLLM_TIMEOUT.name, " 2.5 ")
    assert VLLM_TIMEOUT.seconds() == 2.5
    monkeypatch.setenv(VLLM_TIMEOUT.name, "")
    assert VLLM_TIMEOUT.seconds() == float(VLLM_TIMEOUT.default)

