"""The import contracts of pyproject.toml ([tool.importlinter]), checked with import-linter on the real package:
the packages in layers from the entry points down to core, the three kinds independent of each other, the
light pull client, Dagster only in orchestration. And the same contracts catch a break: a copy of the package
with one forbidden import added fails the contract it breaks, by name. Plus one rule import-linter would need
every module listed for: a GGUF family module imports spec, shared and at most the family it is a variant of."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ("Layers: each package imports only the packages below it", "The three kinds are independent of each other",
             "The light pull client: no engine, model, validation, compat, orchestration, torch or Dagster",
             "Only orchestration, definitions and assets import Dagster")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports of the venv this suite runs in, on the package under `root` (found first on sys.path)."""
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}  # one line per contract name
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
                           "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_every_contract():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for name in CONTRACTS:
        assert f"{name} KEPT" in proc.stdout.splitlines(), (name, proc.stdout[-3000:])
    assert "Contracts: 4 kept, 0 broken." in proc.stdout


@pytest.fixture(scope="module")
def broken_copy(tmp_path_factory) -> Path:
    """The package copied with three forbidden imports: the pull client importing numpy, one kind importing
    another, the store (a low layer) importing the engine."""
    root = tmp_path_factory.mktemp("contracts")
    shutil.copytree(ROOT / "pipelines", root / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    added = {"pipelines/client/pull.py": "import numpy  # noqa\n",
             "pipelines/targets/gguf/__init__.py": "from ..vllm import prepare  # noqa\n",
             "pipelines/store/base.py": "from ..engine import build  # noqa\n"}
    for rel, line in added.items():
        path = root / rel
        path.write_text(path.read_text() + "\n" + line)
    return root


def test_a_forbidden_import_breaks_the_contract_it_crosses(broken_copy):
    proc = lint_imports(broken_copy)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "Contracts: 1 kept, 3 broken." in out, out[-3000:]
    assert "pipelines.client is not allowed to import numpy:" in out and "pipelines.client.pull -> numpy (l." in out
    assert "pipelines.targets.gguf is not allowed to import pipelines.targets.vllm" in out
    assert ("pipelines.store is not allowed to import pipelines.engine:\n\n"
            "- pipelines.store.base -> pipelines.engine.build") in out, out


def test_the_docs_layout_names_every_module():
    """docs/development.md's layout block names each module of pipelines/ (a family module is covered by
    `families/`)."""
    import re

    page = (ROOT / "docs" / "development.md").read_text()
    section = page[page.index("## Layout"):]
    block = section[section.index("```") + 3:section.index("```", section.index("```") + 3)]
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    modules = [p for p in (ROOT / "pipelines").rglob("*.py") if p.name != "__init__.py" and p.parent.name != "families"]
    assert len(modules) > 100
    assert sorted(str(p.relative_to(ROOT)) for p in modules if p.stem not in named) == []



def module_names_in_strings(path: Path) -> list[str]:
    """`line: text` of each string literal in a module that names a module of the package (`pipelines.x`), its
    docstrings aside (prose, which no import follows)."""
    import re

    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [f"{node.lineno}: {node.value[:80]}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and re.search(r"\bpipelines(\.[A-Za-z_]\w*)+", node.value)]


def test_no_string_names_a_module_of_the_package(tmp_path):
    """A module named in a string is an import the import graph (and a move) cannot see: the code passes functions
    and modules themselves, reads its own name from __spec__, and names its kinds and console script only in
    pyproject's entry points. The check itself finds such a string."""
    found = {str(p.relative_to(ROOT)): module_names_in_strings(p)
             for root in ("pipelines", "assets") for p in sorted((ROOT / root).rglob("*.py"))}
    assert {path: lines for path, lines in found.items() if lines} == {}
    planted = tmp_path / "planted.py"
    planted.write_text('"""Names pipelines.core.paths in prose."""\n\nRUN = ("-m", "pipelines.process.isolation")\n')
    assert module_names_in_strings(planted) == ["3: pipelines.process.isolation"]

# A variant may import the family it varies (its parent lineage); no family imports an unrelated one.
GGUF_FAMILY_LINEAGE = {"gemma2": {"gemma"}, "gemma3": {"gemma", "gemma2"}, "granitemoe": {"granite"},
                       "ernie4_5_moe": {"ernie4_5"}, "glm4_moe": {"glm4"}, "granitehybrid": {"granitemoe"},
                       # vision-language wrappers of a text family (its rules under the wrapper's prefixes)
                       "gemma3_vlm": {"gemma3"}, "llava": {"llama"}, "qwen2vl": {"qwen2"}, "qwen3vl": {"qwen3"}}
GGUF_FAMILY_LIBRARIES = {"spec", "shared"}  # the vocabulary and the blocks several families share


def sibling_imports(path: Path) -> set[str]:
    """The sibling modules a module imports (`from .x import ...` / `from . import x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return found


def test_a_gguf_family_imports_shared_blocks_not_other_families(tmp_path):
    """A GGUF family module imports spec, shared and at most its own parent lineage: what several unrelated
    families reuse lives in shared.py, so no family is also a library for the others."""
    families = ROOT / "pipelines" / "targets" / "gguf" / "families"
    modules = {p.stem: p for p in families.glob("*.py") if p.name != "__init__.py"}
    assert set(GGUF_FAMILY_LIBRARIES) <= set(modules) and len(modules) > 30
    stray = {name: sorted(sibling_imports(path) - GGUF_FAMILY_LIBRARIES - GGUF_FAMILY_LINEAGE.get(name, set()))
             for name, path in modules.items() if name not in GGUF_FAMILY_LIBRARIES}
    assert {name: found for name, found in stray.items() if found} == {}
    # the libraries import no family
    assert {name: sorted(sibling_imports(modules[name]) - {"spec"}) for name in GGUF_FAMILY_LIBRARIES} == \
        {"spec": [], "shared": []}
    # the check sees both spellings of a sibling import, and not the package's other modules
    module = tmp_path / "starcoder.py"
    module.write_text("from ....errors import ModelFormatError\nfrom .falcon import regroup_qkv\nfrom . import gpt2\n")
    assert sibling_imports(module) == {"falcon", "gpt2"}
