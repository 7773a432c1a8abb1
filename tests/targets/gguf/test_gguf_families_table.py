"""docs/gguf.md's GGUF family table is the one the family modules generate (pipelines/targets/gguf/family_table.py)."""

from __future__ import annotations

from pathlib import Path

from pipelines.targets.gguf import family_table
from pipelines.targets.gguf.families import BY_ARCHITECTURE, FAMILIES

PAGE = Path(__file__).resolve().parents[3] / "docs" / "gguf.md"


def test_the_docs_table_is_generated_from_the_family_modules():
    text = PAGE.read_text(encoding="utf-8")
    assert family_table.replaced(text) == text, ("docs/gguf.md's GGUF family table is stale: run "
                                                 "python -m pipelines.targets.gguf.family_table --write docs/gguf.md")


def test_every_family_and_architecture_has_a_row():
    table = family_table.table()
    assert all(f"| `{f.name}` | `{f.gguf_arch}` |" in table for f in FAMILIES)
    assert all(f"`{arch}`" in table for arch in BY_ARCHITECTURE)
    assert table.startswith(f"{len(FAMILIES)} families, {len(BY_ARCHITECTURE)} HF architectures")
