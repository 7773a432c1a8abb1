"""Writing a GGUF's metadata: gguf-py's writer with its arrays packed whole, a family's typed keys, and the
general.* keys llama.cpp's converter writes.

The writer packs the same bytes as gguf-py's, without a Python call per item. A 128k-token vocabulary is
three arrays of 128k items (pieces, scores, types); gguf-py packs them item by item through `_pack_val` (about
385,000 calls: over a second, before a byte of tensor data is written, and as long for a 1B model as for a 70B
one). Here a list whose items are all of one plain kind (strings, floats, ints, bools) is packed in one pass with
the same layout: the item type, the count, then each item as gguf-py writes it. Anything else (a mixed list, a
nested array, a big-endian file) is left to gguf-py.
"""

from __future__ import annotations

import struct
import tempfile
from itertools import chain
from pathlib import Path
from typing import Any

import gguf
import numpy as np

V = gguf.GGUFValueType
_NUMERIC = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
            V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT32: "<f4", V.FLOAT64: "<f8"}
_LENGTH = struct.Struct("<Q")


def _all(kinds: set[type], test) -> bool:
    return all(test(k) for k in kinds)


def _text(k: type) -> bool:
    return issubclass(k, (str, bytes, bytearray))


def _integer(k: type) -> bool:
    return issubclass(k, int) and not issubclass(k, bool)


def _flag(k: type) -> bool:
    return issubclass(k, bool)


def _item_type(kinds: set[type]) -> V | None:
    """The one GGUF type gguf-py would give every item of these Python types (its get_type), else None."""
    if _all(kinds, _text):
        return V.STRING
    if kinds == {float}:
        return V.FLOAT32
    if _all(kinds, _flag):
        return V.BOOL
    if _all(kinds, _integer):
        return V.INT32
    return None


def _pack_items(items: list[Any], item_type: V, kinds: set[type]) -> bytes | None:
    """The items as gguf-py packs them one by one, or None where this cannot promise the same bytes (the
    item type may be the caller's, so the items are checked against it)."""
    if item_type == V.STRING:
        if not _all(kinds, _text):
            return None
        encoded = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in items]
        return b"".join(chain.from_iterable(zip(map(_LENGTH.pack, map(len, encoded)), encoded)))
    if item_type == V.BOOL:
        return bytes(bool(b) for b in items) if _all(kinds, _flag) else None
    fmt = _NUMERIC.get(item_type)
    if fmt is None:
        return None
    if fmt[1] == "f":
        if kinds != {float}:  # struct packs an int as a float too; keep such lists with gguf-py
            return None
        with np.errstate(over="ignore", invalid="ignore"):
            packed = np.asarray(items, dtype=np.float64).astype(fmt)
        return packed.tobytes() if np.isfinite(packed).all() else None  # struct refuses what overflows: it says so
    if not _all(kinds, _integer):
        return None
    values = [int(i) for i in items]
    info = np.iinfo(fmt)
    if min(values) < info.min or max(values) > info.max:
        return None  # struct raises for it: let gguf-py say so
    return np.asarray(values, dtype=fmt).tobytes()


class GGUFWriter(gguf.GGUFWriter):
    def _pack_val(self, val: Any, vtype: V, add_vtype: bool, sub_type: V | None = None) -> bytes:
        if vtype != V.ARRAY or not isinstance(val, list) or not val or self.endianess != gguf.GGUFEndian.LITTLE:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        kinds = set(map(type, val))
        item_type = sub_type if sub_type is not None else _item_type(kinds)
        items = _pack_items(val, item_type, kinds) if item_type is not None else None
        if items is None:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        return head + struct.pack("<IQ", item_type, len(val)) + items


def add_key_value(writer: gguf.GGUFWriter, key: str, value: Any, kind: type) -> None:
    """A family's key, written as the type its declaration names."""
    if kind is bool:
        writer.add_bool(key, bool(value))
    elif kind is int:
        writer.add_uint32(key, int(value))
    elif kind is float:
        writer.add_float32(key, float(value))
    elif kind is list:
        writer.add_array(key, list(value))  # per-layer values (a sliding-window pattern of bools)
    else:
        writer.add_string(key, str(value))


def general_metadata(writer: gguf.GGUFWriter, model_dir: Path, model_id: str) -> dict[str, Any]:
    """The general.* keys llama.cpp's converter writes, with its own rules (gguf-py's Metadata: the model card's
    front matter, config.json's `_name_or_path`, then heuristics on the directory name): name, basename,
    finetune, size_label, license, base_model.*, repo_url, ... A snapshot's directory is named by its commit,
    so the heuristics are shown a directory named after the repository (links to the files they read), as
    llama.cpp sees one when it converts a `--local-dir <repo>` download."""
    total, shared, expert, experts = writer.get_total_parameter_count()
    with tempfile.TemporaryDirectory(prefix="gguf-metadata-") as tmp:
        view = Path(tmp) / model_id.rsplit("/", 1)[-1]
        view.mkdir()
        for f in ("README.md", "config.json", "generation_config.json"):
            if (model_dir / f).is_file():
                (view / f).symlink_to((model_dir / f).resolve())
        meta = gguf.Metadata.load(None, view, None, total)
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, experts)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)
    return {k: v for k, v in vars(meta).items() if v not in (None, [], {})}


__all__ = ["GGUFWriter", "add_key_value", "general_metadata"]
