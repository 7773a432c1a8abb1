"""k-quants and other llama.cpp file types through libllama's own quantizer."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ...errors import HiveError

# Names as in llama.cpp's LLAMA_FTYPE_MOSTLY_*; values are its enum.
FTYPES = {
    "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13,
    "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "TQ1_0": 36,
    "TQ2_0": 37,
}
# These need an importance matrix, which the Python bindings cannot compute.
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ3_XXS", "Q2_K_S"}


def quantize(src: Path, dst: Path, ftype: str, threads: int | None = None) -> None:
    import llama_cpp
    from llama_cpp import _logger

    # libllama logs one line per tensor (e.g. k-quant fallbacks for rows not a multiple of 256,
    # which is expected); keep stderr for errors.
    _logger.set_verbose(False)
    name = ftype.upper()
    if name in NEEDS_IMATRIX:
        raise HiveError(f"{name} needs an importance matrix, which hive-aot does not compute yet")
    if name not in FTYPES:
        raise HiveError(f"unknown llama.cpp file type {ftype!r} (known: {', '.join(sorted(FTYPES))})")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    params.nthread = threads or os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise HiveError(f"llama.cpp quantization to {name} failed (return code {rc})")
