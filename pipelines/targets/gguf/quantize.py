"""k-quants and other llama.cpp file types through libllama's own quantizer.

libllama runs in a child process (pipelines.process.isolation), and its log is captured there: a k-quant
whose rows are not a multiple of 256 falls back to another type for some tensors, which llama.cpp
reports in one warning per tensor (about 180 lines for a small model). That is expected, so the
build prints one summary line and records the counts per (requested type, fallback type).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from ...core.errors import HiveError
from ...core.progress import bar
from .ftypes import FTYPES
from .tensor_quant import type_overrides

# llama.cpp refuses these without an importance matrix (its quantizer's own list): hive-aot computes one
# (imatrix.py) when the recipe sets `imatrix: calibration`.
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ3_XXS", "Q2_K_S"}

# llama-quant.cpp: "warning: <tensor> - ncols <n> not divisible by <k> (required for type <t>) [(WARNING: must
# use F16 due to unusual shape) ]-> falling back to <t2>", logged in several pieces.
_FALLBACK = re.compile(r"warning: (\S+)\s+- ncols\s+\d+ not divisible by\s+\d+ \(required for type\s+(\S+)\)\s*"
                       r"(?:\(WARNING: must use F16 due to unusual shape\)\s*)?-> falling back to\s+(\S+)")
_TOTAL = re.compile(r"(\d+) of (\d+) tensor\(s\) required fallback quantization")
_TENSOR = re.compile(r"\[\s*(\d+)/\s*(\d+)\]")  # "[  12/ 201] blk.0.attn_q.weight - ...": one line per tensor
GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5


def quantize(src: Path, dst: Path, ftype: str, *, step: str | None = None, threads: int | None = None,
             imatrix: Path | None = None, keep_split: bool = False) -> dict[str, Any]:
    """Quantize src to dst (weighted by the importance matrix file `imatrix` when given); returns
    {"tensors": n, "fallbacks": [{"from", "to", "tensors"}]} and prints one line. `keep_split`: src is the
    first shard of a split GGUF and dst is written as the same shards, `<dst stem>-0000i-of-0000n.gguf`."""
    from ...process.isolation import run_isolated

    name = ftype.upper()
    if name not in FTYPES:
        raise HiveError(f"unknown llama.cpp file type {ftype!r} (known: {', '.join(sorted(FTYPES))})")
    if name in NEEDS_IMATRIX and imatrix is None:
        raise HiveError(f"{name} needs an importance matrix: set the recipe option imatrix: calibration")
    summary = run_isolated(quantize_here, engine="llama.cpp",
                           step=step or f"{name} quantization of {src.name}",
                           src=str(src), dst=str(dst), name=name, threads=threads or os.cpu_count() or 1,
                           imatrix=str(imatrix) if imatrix else None, keep_split=keep_split)
    if summary["fallbacks"]:
        n = sum(f["tensors"] for f in summary["fallbacks"])
        kinds = ", ".join(f"{f['from']}->{f['to']} x{f['tensors']}" for f in summary["fallbacks"])
        print(f"llama.cpp {name}: {n} of {summary['tensors'] or '?'} tensors fell back to another type ({kinds}): "
              "their rows are not a multiple of the type's block size, which is expected", file=sys.stderr)
    return summary


def stored_quantized(src: Path) -> list[tuple[str, int]]:
    """(name, ggml type) of the tensors the lossless GGUF `src` (and its other shards, which libllama loads with
    the first) holds already quantized: those a family writes as stored (gpt-oss's MXFP4 experts), which the
    quantizer keeps (tensor_quant.type_overrides)."""
    import gguf

    from .tensor_quant import FLOAT_GGML_TYPES

    shards = [src]
    split = re.fullmatch(r"(.+)-00001-of-(\d{5})\.gguf", src.name)
    if split:
        shards = sorted(src.parent.glob(f"{split.group(1)}-[0-9][0-9][0-9][0-9][0-9]-of-{split.group(2)}.gguf"))
    return [(t.name, int(t.tensor_type)) for shard in shards for t in gguf.GGUFReader(str(shard)).tensors
            if int(t.tensor_type) not in FLOAT_GGML_TYPES]


def quantize_here(src: str, dst: str, name: str, threads: int, imatrix: str | None = None,
                  keep_split: bool = False) -> dict[str, Any]:
    """Runs in the child: libllama's quantizer with its log captured instead of printed."""
    import llama_cpp

    pieces: list[str] = []
    errors: list[str] = []
    last_level = 0
    tensors = bar(None, "quantize", unit="tensor")  # its total comes with the first tensor's line

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, _user_data) -> None:
        nonlocal last_level
        level = last_level if level == GGML_LOG_LEVEL_CONT else level
        last_level = level
        msg = text.decode("utf-8", "replace")
        pieces.append(msg)
        if level == GGML_LOG_LEVEL_ERROR:
            errors.append(msg)
        counted = _TENSOR.match(msg)
        if counted:
            tensors.total = int(counted.group(2))
            tensors.update(int(counted.group(1)) - tensors.n)

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    overrides = type_overrides(stored_quantized(Path(src)))
    if overrides is not None:  # tensors the source keeps quantized as stored (MXFP4 experts) stay so
        params.tt_overrides = overrides
    params.nthread = threads
    params.keep_split = keep_split
    # llama.cpp names shards `<prefix>-0000i-of-0000n.gguf` from the output name it is given
    target = str(Path(dst).with_suffix("")) if keep_split else dst
    if imatrix:
        from .imatrix import as_quantize_param, load

        entries, _keep = as_quantize_param(load(Path(imatrix)))  # _keep: the arrays the entries point into
        params.imatrix = entries
    with tensors:
        rc = llama_cpp.llama_model_quantize(src.encode(), target.encode(), ctypes.byref(params))
    written = sorted(Path(dst).parent.glob(Path(dst).stem + "-*-of-*.gguf")) if keep_split else [Path(dst)]
    if errors:
        sys.stderr.write("".join(errors))
    if rc != 0 or not written or not all(p.is_file() for p in written):
        for p in written:
            p.unlink(missing_ok=True)
        from ...core.host import disk_full_error, out_of_space

        full = out_of_space(Path(dst).parent)  # llama.cpp says only "iostream error"
        if full is not None:
            error = disk_full_error(full, Path(dst).parent, subject=f"llama.cpp quantization to {name}", step="quantize")
            Path(dst).unlink(missing_ok=True)  # now: the child still has its result to write on this disk
            raise error
        last = " ".join("".join(errors).split())[-300:]
        raise HiveError(f"llama.cpp quantization to {name} failed (return code {rc}){': ' + last if last else ''}")
    log = "".join(pieces)
    counts = Counter((m.group(2), m.group(3)) for m in _FALLBACK.finditer(log))
    total = _TOTAL.search(log)
    return {
        "tensors": int(total.group(2)) if total else None,
        "fallbacks": [{"from": a, "to": b, "tensors": n} for (a, b), n in sorted(counts.items())],
        "files": [p.name for p in written],
    }
