"""Rules streamed expert by expert: inputs sliced together along their first axis, never whole.

Fused expert tensors ([experts, ...] in one checkpoint tensor) are rearranged per expert (gpt-oss's
`gate_up_proj` [E, H, 2I], gate and up interleaved, becomes gate and up [E, I, H]): a rule whose transform
is `sliced` gets the same rows [lo, hi) of every input and makes those rows of its one output, so a layer's
experts (8.5 GB in fp32 for a 120B's gate_up) stream through slices of SLICE_BYTES.

Some checkpoints ship tensors quantized in a form llama.cpp keeps: gpt-oss is released with MXFP4 experts
(E2M1 values packed two to a byte, one E8M0 scale per 32), which llama.cpp keeps MXFP4 in every file type,
its converter repacking the bytes into ggml's `block_mxfp4` without dequantizing them. A transform that
fixes its output type (`fixed`) gets the packed inputs as stored and returns that type's bytes; the family
accepts the checkpoint's quant_method (`Family.quantizations`), and a k-quant keeps such tensors as they
are (tensor_quant.py, quantize.py: llama.cpp's own per-tensor type override).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from ...core.errors import ModelFormatError
from ...source.safetensors_io import TensorSource
from .families import HParams
from .tensor_writer import TensorWriter, encode_threads, in_order

Q = gguf.GGMLQuantizationType
F = gguf.LlamaFileType
PACKED_DTYPES = ("U8", "I8")  # how checkpoints store packed blocks and E8M0 scales
LOSSLESS = ("f32", "f16", "bf16")


def reads_quantization(architecture: str | None, quantization_config: Any) -> bool:
    """Whether the GGUF family of `architecture` reads the tensors of this quantization_config as stored
    (gpt-oss's MXFP4 experts); any other pre-quantized checkpoint is refused by the converter."""
    from .families import BY_ARCHITECTURE

    family = BY_ARCHITECTURE.get(architecture or "")
    method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) else None
    return family is not None and isinstance(method, str) and method.lower() in family.quantizations


def file_type(outtype: str, default: F, outputs: list) -> F:
    """general.file_type: the outtype's (`default`), except that a lossless outtype with MXFP4 tensors kept as
    stored is MOSTLY_MXFP4_MOE, as llama.cpp's converter names that file."""
    if outtype in LOSSLESS and any(o.fixed and o.qtype == Q.MXFP4 for o in outputs):
        return F.MOSTLY_MXFP4_MOE
    return default


def stored_rows(tensors: TensorSource, name: str, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of a packed tensor as stored (uint8): a view of the mapped file, nothing widened."""
    info = tensors.info(name)
    if info.dtype not in PACKED_DTYPES:
        raise ModelFormatError(f"tensor {name!r} is {info.dtype}: its rule reads packed bytes (U8)")
    return tensors.where[name].raw(name).reshape(info.shape)[lo:hi]


def write_sliced(step, tensors: TensorSource, hp: HParams, sink: TensorWriter, pb, slice_bytes: int,
                 encode: Callable[[np.ndarray], np.ndarray]) -> None:
    """One sliced rule (convert.Step): its inputs sliced together along their first axis, about `slice_bytes`
    of the first input at a time, transformed and encoded on worker threads and written in order; each slice's
    pages dropped from the resident set once written. A fixed-type rule reads the packed bytes as stored and
    writes what it returns; any other is read in float32 and its result `encode`d (checked, to its type)."""
    transform = step.rule.transform
    rows = tensors.info(step.inputs[0]).shape[0]
    for n in step.inputs[1:]:
        if tensors.info(n).shape[:1] != (rows,):
            raise ModelFormatError(f"{n} has {list(tensors.info(n).shape)[:1]} experts, {step.inputs[0]} has {rows}")
    row_bytes = {n: tensors.info(n).nbytes // max(1, rows) for n in step.inputs}
    first = tensors.info(step.inputs[0])  # a slice's size: as stored when packed, else widened to float32
    in_memory = row_bytes[first.name] if transform.fixed is not None else 4 * (first.numel // max(1, rows))
    per_slice = max(1, slice_bytes // max(1, in_memory))
    read = stored_rows if transform.fixed is not None else (lambda t, n, lo, hi: t.rows(n, lo, hi))

    def job(lo: int, hi: int):
        def run():
            out = transform.apply([read(tensors, n, lo, hi) for n in step.inputs], hp)[0]
            if transform.fixed is not None:
                return np.ascontiguousarray(out, dtype=np.uint8), lo, hi
            return encode(out), lo, hi
        return run

    def write(result) -> None:
        data, lo, hi = result
        sink.write(data)
        for n in step.inputs:
            tensors.release(n, lo * row_bytes[n], hi * row_bytes[n])

    in_order((job(lo, min(rows, lo + per_slice)) for lo in range(0, rows, per_slice)), write, encode_threads())
    sink.close()
    pb.update(step.source_bytes)
