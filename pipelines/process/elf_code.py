"""The digest of a shared library's machine code, for toolchain keys.

A native library compiled for another CPU level runs other kernels, so the library's identity belongs in a
build id; but its whole file also holds the path of the directory it was compiled in (llama.cpp's asserts
print `__FILE__`, and pip builds in a random `/tmp/pip-wheel-XXXXXXXX/llama-cpp-python_<32 hex>/`), so two
hosts compiling the same source at the same CPU level got different digests and rebuilt the same artifact
under two build ids. The executable sections (ELF sections flagged SHF_EXECINSTR: .text, .plt, .init, .fini)
are what decides the kernels; path strings live in .rodata and debug sections, which this leaves out. The
random directory names are of fixed length, so the code's references into .rodata do not move either.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

SHF_EXECINSTR = 0x4
SHT_NOBITS = 8
_ELF64_LE = b"\x7fELF\x02\x01"


class Section(NamedTuple):
    name: bytes
    kind: int
    flags: int
    data: bytes


def sections(data: bytes) -> Iterator[Section]:
    """The sections of a little-endian ELF64 file's bytes, in header order; none when it is not one."""
    if not data.startswith(_ELF64_LE):
        return
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for name_off, kind, flags, _addr, offset, size in headers:
        start = names_at + name_off
        yield Section(data[start:data.index(b"\0", start)], kind, flags,
                      b"" if kind == SHT_NOBITS else data[offset:offset + size])


def section(path: Path, name: str) -> bytes | None:
    """The bytes of the named section of a little-endian ELF64 file; None when it has none (or is not one)."""
    return next((s.data for s in sections(Path(path).read_bytes()) if s.name == name.encode()), None)


def code_digest(path: Path) -> str:
    """sha256 over the names, sizes and bytes of the executable sections of a little-endian ELF64 file; a file
    that is not one is hashed whole."""
    data = Path(path).read_bytes()
    if not data.startswith(_ELF64_LE):
        return hashlib.sha256(data).hexdigest()
    digest = hashlib.sha256()
    for s in sections(data):
        if s.flags & SHF_EXECINSTR and s.kind != SHT_NOBITS:
            digest.update(s.name + b"\0" + len(s.data).to_bytes(8, "little") + s.data)
    return digest.hexdigest()


__all__ = ["Section", "code_digest", "section", "sections"]
