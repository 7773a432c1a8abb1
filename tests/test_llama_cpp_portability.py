"""The installed llama.cpp must run on every x86-64 CPU of its level, not just the one that built it.

A wheel compiled with GGML_NATIVE used AMX tile instructions on the host that built it and died with
SIGILL elsewhere. `make setup` compiles llama-cpp-python for a fixed level
(requirements/llama-cpp/<level>.cmake) with -frecord-gcc-switches, so each library carries the
compiler flags it was built with in its `.GCC.command.line` section. This test reads them (a
library without them has unknown provenance and fails) and disassembles the CPU backend to prove
that no AMX tile and no AVX-512 instruction is in it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import llama_cpp
import pytest

REPO = Path.cwd()
LIB_DIR = Path(llama_cpp.__file__).parent / "lib"
LEVEL = os.environ.get("HIVE_AOT_LLAMA_CPU_LEVEL") or subprocess.run(
    [str(REPO / "requirements" / "llama-cpp" / "level.sh")], capture_output=True, text=True, check=True).stdout.strip()
# Flags that tie a binary to the CPU that built it, or to instructions only some hosts have.
FORBIDDEN_FLAGS = re.compile(r"-march=native|-mtune=native|-mcpu=native|-mamx[-\w]*|-mavx512\w*|-mavxvnni")
EXPECTED_FLAGS = {"x86-64-v3": {"-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi2"}, "x86-64-v2": {"-msse4.2"}}
# AMX tile registers and instructions; AVX-512 zmm and mask registers.
FORBIDDEN_ASM = re.compile(r"%tmm\d|\btile(zero|loadd|stored|release|cfg)|\btdpb|%zmm\d|%k[1-7]\b")


def _libraries() -> list[Path]:
    libs = sorted(p for p in LIB_DIR.glob("lib*.so") if p.is_file())  # one name per library
    assert any(p.name.startswith("libggml-cpu") for p in libs), f"no libggml-cpu in {LIB_DIR}"
    return libs


def _recorded_flags(lib: Path) -> set[str]:
    out = subprocess.run(["readelf", "--string-dump=.GCC.command.line", str(lib)], capture_output=True, text=True)
    return set(re.findall(r"(?<!\S)-[^\s\]]+", out.stdout))


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils missing")
@pytest.mark.parametrize("lib", _libraries(), ids=lambda p: p.name)
def test_library_was_built_with_the_portable_flags(lib):
    flags = _recorded_flags(lib)
    assert flags, f"{lib.name} records no compiler flags: not built by `make setup` (unknown CPU requirements)"
    assert sorted(f for f in flags if FORBIDDEN_FLAGS.fullmatch(f)) == []
    if lib.name.startswith("libggml-cpu"):
        assert EXPECTED_FLAGS.get(LEVEL, set()) <= flags, f"{lib.name} was not built for {LEVEL}"


@pytest.mark.skipif(shutil.which("objdump") is None, reason="binutils missing")
def test_cpu_backend_has_no_amx_or_avx512_instructions():
    (cpu,) = [p for p in _libraries() if p.name.startswith("libggml-cpu")]
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(cpu)], capture_output=True, text=True, check=True)
    assert "vfmadd" in asm.stdout or LEVEL != "x86-64-v3"  # the disassembly is real: FMA code is there
    hits = [line.strip() for line in asm.stdout.splitlines() if FORBIDDEN_ASM.search(line)]
    assert hits[:5] == []


def test_compiled_features_are_the_levels():
    info = llama_cpp.llama_print_system_info().decode()
    assert "AMX_INT8 = 1" not in info and "AVX512 = 1" not in info, info
    if LEVEL == "x86-64-v3":
        assert "AVX2 = 1" in info and "FMA = 1" in info, info


def test_cached_wheel_is_keyed_by_level_and_flags():
    dirs = {}
    for level in ("x86-64-v2", "x86-64-v3"):
        out = subprocess.run(["make", "-s", "--no-print-directory", "print-llama-wheels", f"LLAMA_CPU_LEVEL={level}"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        args = " ".join(line for line in (REPO / "requirements" / "llama-cpp" / f"{level}.cmake").read_text().splitlines()
                        if not line.lstrip().startswith("#"))
        version = re.search(r"LLAMA_CPP_VERSION := (\S+)", (REPO / "Makefile").read_text()).group(1)
        digest = hashlib.sha256(f"{version} {args} ".encode()).hexdigest()[:12]
        assert out.endswith(f"/llama-cpp-python-{version}-{level}-{digest}"), out
        dirs[level] = out
    assert dirs["x86-64-v2"] != dirs["x86-64-v3"]
    assert os.environ.get("HIVE_AOT_LLAMA_WHEELS") in (None, dirs.get(LEVEL))


def test_cpu_backend_build_enters_the_build_id():
    """Another compile of the same version (another CPU level) is another toolchain: build ids differ."""
    from pipelines.process.elf_code import code_digest
    from pipelines.targets.gguf import GgufTarget

    (cpu,) = [p for p in _libraries() if p.name.startswith("libggml-cpu")]
    assert GgufTarget().toolchain()["llama_cpp_cpu_backend"] == code_digest(cpu)[:16]


def test_the_directory_pip_compiled_in_does_not_enter_the_build_id(tmp_path):
    """Red team round two, item 24: libggml-cpu embeds the random directory pip compiled it in (llama.cpp's asserts
    print __FILE__), so one build per factory host had its own build id. The same library with another random
    directory (what a second compile of the same source at the same CPU level gives: fixed-length names, so
    nothing else moves) has the same code digest; other code has another."""
    import re

    from pipelines.core.hashing import sha256_file
    from pipelines.process.elf_code import code_digest

    (cpu,) = [p for p in _libraries() if p.name.startswith("libggml-cpu")]
    data = cpu.read_bytes()
    pattern = rb"(/tmp/pip-[a-z]+-)[A-Za-z0-9_]{8}(/llama-cpp-python_)[0-9a-f]{32}"
    assert re.search(pattern, data), "libggml-cpu no longer embeds pip's build directory: this test's premise is gone"
    elsewhere = tmp_path / cpu.name
    elsewhere.write_bytes(re.sub(pattern, rb"\g<1>aaaabbbb\g<2>" + b"c" * 32, data))
    assert sha256_file(elsewhere) != sha256_file(cpu) and code_digest(elsewhere) == code_digest(cpu)
    (base,) = [p for p in _libraries() if p.name.startswith("libggml-base")]
    assert code_digest(base) != code_digest(cpu)
