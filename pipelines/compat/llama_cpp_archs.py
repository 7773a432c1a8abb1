"""Which HF architectures llama.cpp converts, and to what, read from the llama.cpp the project pins.

llama.cpp's `convert_hf_to_gguf.py` registers one converter class per group of HF architecture names
(`@ModelBase.register("Qwen3ForCausalLM", ...)` in its `conversion/` package); the class, or a base class,
names the GGUF architecture (`model_arch = gguf.MODEL_ARCH.QWEN3`). Vision-language models register a
second class for their projector, whose architecture is `MMPROJ`. Both are read statically from the
llama-cpp-python sdist of the pinned version (downloaded once with pip, never imported or run), so the
architecture database (`sync.py`) says, without a hand-kept list, which models the llama.cpp profile runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tarfile
from pathlib import Path

from ..core.errors import HiveError
from ..core.paths import cache_root

CONVERSION = "vendor/llama.cpp/conversion/"
PROJECTOR = "MMPROJ"


def _register_names(node: ast.ClassDef) -> list[str]:
    names = []
    for deco in node.decorator_list:
        if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.func.attr == "register"
                and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "ModelBase"):
            names += [a.value for a in deco.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return names


def _own_arch(node: ast.ClassDef) -> str | None:
    """`model_arch = gguf.MODEL_ARCH.X` in the class body: X."""
    for stmt in node.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
        value = getattr(stmt, "value", None)
        if (isinstance(target, ast.Name) and target.id == "model_arch" and isinstance(value, ast.Attribute)
                and isinstance(value.value, ast.Attribute) and value.value.attr == "MODEL_ARCH"):
            return value.attr
    return None


def parse(modules: dict[str, str]) -> dict[str, dict[str, str | bool]]:
    """HF architecture -> {"arch": GGUF architecture name, "mmproj": True when a projector converter exists},
    from the sources of the converter's `conversion/` modules (file name -> text)."""
    classes: dict[str, tuple[list[str], str | None, list[str]]] = {}  # name -> (bases, own arch, registered)
    for text in modules.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes[node.name] = (bases, _own_arch(node), _register_names(node))

    def arch_of(name: str, seen: frozenset = frozenset()) -> str | None:
        if name not in classes or name in seen:
            return None
        bases, own, _ = classes[name]
        return own or next((a for b in bases if (a := arch_of(b, seen | {name}))), None)

    out: dict[str, dict[str, str | bool]] = {}
    for name, (_, _, registered) in sorted(classes.items()):
        arch = arch_of(name)
        if arch is None:
            continue
        for hf in registered:
            entry = out.setdefault(hf, {})
            if arch == PROJECTOR:
                entry["mmproj"] = True
            else:
                entry.setdefault("arch", _gguf_name(arch))
    return dict(sorted(out.items()))


def _gguf_name(member: str) -> str:
    """MODEL_ARCH member -> the architecture name GGUF files carry (gguf-py's table; lower case if it lacks it)."""
    import gguf

    arch = getattr(gguf.MODEL_ARCH, member, None)
    return gguf.MODEL_ARCH_NAMES.get(arch, member.lower()) if arch is not None else member.lower()


def sdist(version: str) -> Path:
    """The llama-cpp-python sdist of `version`, downloaded once into the cache."""
    cache = cache_root() / "downloads" / "llama-cpp-python"
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                        str(cache), f"llama-cpp-python=={version}"], check=True)
        found = sorted(cache.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        raise HiveError(f"could not download the llama-cpp-python {version} sdist")
    return found[0]


def from_sdist(path: Path) -> dict[str, dict[str, str | bool]]:
    with tarfile.open(path) as tf:
        modules = {}
        for member in tf.getmembers():
            rel = member.name.split("/", 1)[-1]
            if rel.startswith(CONVERSION) and rel.endswith(".py") and member.isfile():
                modules[rel] = tf.extractfile(member).read().decode("utf-8")
    if not modules:
        raise HiveError(f"{path.name} has no {CONVERSION}: the converter's layout changed, update llama_cpp_archs.py")
    return parse(modules)
