"""gguf-py's GGUFReader with its two hot paths made cheap, for tests that read many GGUF files.

gguf-py parses every element of an array field through a numpy memmap slice, so a file with the
SmolLM2 vocabulary (49,152 tokens, 48,900 merges) took 8 s to open, and the GGUF family tests
opened four per case: about two thirds of their time. This subclass keeps gguf-py's parser and its
result (the same `fields` with the same parts, the same `tensors`), but slices a plain ndarray view
of the mapping (memmap's per-slice `__array_finalize__` was the other half) and walks arrays of
strings and scalars with one loop instead of a recursive call per element.
`test_gguf_reader.py` holds it equal to gguf-py's own reader on a real file.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
from gguf.constants import GGUFValueType


class FastGGUFReader(gguf.GGUFReader):
    def _plain(self) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self._plain_data = self.data.view(np.ndarray)
        return plain

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        count = int(count)
        itemsize = np.dtype(dtype).itemsize
        arr = self._plain()[offset:offset + itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = GGUFValueType(raw_itype[0]), int(alen[0])
        if n == 0 or (itype != GGUFValueType.STRING and itype not in self.gguf_scalar_to_np):
            return super()._get_field_parts(orig_offs, raw_type)  # empty and nested arrays: gguf-py's own walk
        offs = orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == GGUFValueType.STRING:
            plain, order = self._plain(), np.dtype(np.uint64).newbyteorder(self.byte_order)
            for _ in range(n):
                slen = plain[offs:offs + 8].view(order)
                size = int(slen[0])
                parts += (slen, plain[offs + 8:offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, 2 + 2 * n + 1, 2)), [GGUFValueType.ARRAY, itype]
        values = self._get(offs, self.gguf_scalar_to_np[itype], n)
        parts += (values[i:i + 1] for i in range(n))
        return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, itype]
