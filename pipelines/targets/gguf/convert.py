"""The streaming HF -> GGUF engine: plan every tensor from headers, write metadata, then stream.

Peak memory is about one tensor in float32 (plus its encoded copy), never the model: shapes come
from the safetensors headers, so the GGUF header is written before any tensor data is read, and
each tensor is read through mmap, transformed, encoded and written before the next one. A tensor with
NaN/Inf values is refused as it streams by, and a refused conversion leaves no partial file behind.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ...errors import ModelFormatError
from ...progress import bar
from ...safetensors_io import TensorSource
from .families import Family, HParams, TensorRule, family_for, is_ignored
from .vocab import build_vocab, write_vocab

Q = gguf.GGMLQuantizationType
F = gguf.LlamaFileType

# outtype -> (tensor type for 2-D weights, general.file_type)
OUTTYPES: dict[str, tuple[Q, F]] = {
    "f32": (Q.F32, F.ALL_F32),
    "f16": (Q.F16, F.MOSTLY_F16),
    "bf16": (Q.BF16, F.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0),
}


@dataclass
class Planned:
    gguf_name: str
    hf_name: str | None  # None for tensors the family synthesizes (rope_freqs)
    shape: tuple[int, ...]
    qtype: Q
    rule: TensorRule | None = None
    data: np.ndarray | None = None


@dataclass
class ConvertReport:
    architecture: str
    gguf_arch: str
    outtype: str
    tensors: int
    tensor_types: dict[str, int]
    parameters: int
    vocab: dict[str, Any]


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A nested text config wins (multimodal wrappers); fold the outer architectures in."""
    tc = cfg.get("text_config")
    if isinstance(tc, dict):
        return {**tc, "architectures": tc.get("architectures") or cfg.get("architectures")}
    return cfg


def tensor_type(shape: tuple[int, ...], outtype: str) -> Q:
    if len(shape) <= 1:
        return Q.F32  # norms and biases stay f32 in every llama.cpp file type
    qtype = OUTTYPES[outtype][0]
    if qtype == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        return Q.F16  # rows that are not whole blocks fall back, as llama.cpp does
    return qtype


def plan_tensors(family: Family, hp: HParams, tensors: TensorSource, outtype: str) -> list[Planned]:
    plan: list[Planned] = []
    used: set[str] = set()
    tied = bool(hp.get("tie_word_embeddings", False))

    def take(rule: TensorRule, bid: int | None) -> None:
        hf = rule.hf.format(bid=bid)
        name = rule.gguf.format(bid=bid)
        if hf not in tensors:
            if rule.optional:
                return
            raise ModelFormatError(f"missing tensor {hf!r} for {family.name} (needed for {name})")
        used.add(hf)
        if hf == "lm_head.weight" and tied:
            return  # tied: llama.cpp reuses token_embd; an identical lm_head copy is dropped
        shape = tuple(tensors.info(hf).shape)
        plan.append(Planned(name, hf, shape, tensor_type(shape, outtype), rule))

    for rule in family.global_tensors:
        take(rule, None)
    if not tied and "lm_head.weight" not in tensors:
        raise ModelFormatError("lm_head.weight is missing and tie_word_embeddings is false")
    for bid in range(hp.n_layers):
        for rule in family.block_tensors:
            take(rule, bid)
    for name, data in family.extra_tensors(hp).items():
        plan.append(Planned(name, None, tuple(data.shape), Q.F32, None, data))
    leftover = sorted(n for n in tensors if n not in used and not is_ignored(family, n))
    if leftover:
        more = f" and {len(leftover) - 3} more" if len(leftover) > 3 else ""
        raise ModelFormatError(f"unmapped tensors for {family.name}: {', '.join(leftover[:3])}{more}")
    _check_shapes(plan, hp)
    return plan


def _check_shapes(plan: list[Planned], hp: HParams) -> None:
    hidden, vocab = int(hp.require("hidden_size")), int(hp.require("vocab_size"))
    for p in plan:
        if p.gguf_name == "token_embd.weight" and p.shape != (vocab, hidden):
            raise ModelFormatError(f"embedding is {list(p.shape)}, config says vocab_size={vocab}, hidden_size={hidden}")
        if re.fullmatch(r"blk\.\d+\.attn_q\.weight", p.gguf_name) and p.shape != (hp.n_head * hp.head_dim, hidden):
            raise ModelFormatError(f"{p.hf_name} is {list(p.shape)}, config implies {[hp.n_head * hp.head_dim, hidden]}")
        if re.fullmatch(r"blk\.\d+\.attn_k\.weight", p.gguf_name) and p.shape != (hp.n_head_kv * hp.head_dim, hidden):
            raise ModelFormatError(f"{p.hf_name} is {list(p.shape)}, config implies {[hp.n_head_kv * hp.head_dim, hidden]}")


def _encode(data: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F16:
        with np.errstate(over="ignore"):  # overflow to Inf is detected (and refused) by the caller
            return np.ascontiguousarray(data, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def _nonfinite(data: np.ndarray) -> int:
    """How many NaN/Inf values a tensor holds: numerical validation only sees the rows its prompts touch.

    The boolean mask is a quarter of the float32 tensor already in hand and is freed before the encoded copy
    is made, so the converter's peak memory does not grow; counting runs only on the failure path.
    """
    if np.isfinite(data).all():
        return 0
    return int(data.size - np.count_nonzero(np.isfinite(data)))


def convert(model_dir: Path, cfg: dict[str, Any], safetensors: list[Path], out_path: Path, outtype: str,
            *, name: str, options: dict[str, Any] | None = None) -> ConvertReport:
    if outtype not in OUTTYPES:
        raise ModelFormatError(f"GGUF outtype {outtype!r} is not written directly (use one of {', '.join(OUTTYPES)})")
    options = options or {}
    tcfg = text_config(cfg)
    if cfg.get("quantization_config") is not None or tcfg.get("quantization_config") is not None:
        # Pre-quantized weights (GPTQ/AWQ/FP8 ... or a garbage entry) would be read here as if they were plain
        # floats and published as an unquantized model; `check` keeps the GGUF recipes off such models too.
        raise ModelFormatError(f"{name}: config.json has a quantization_config; the GGUF converter reads only "
                               "unquantized float weights")
    arch = (tcfg.get("architectures") or [None])[0]
    family = family_for(arch)
    hp = HParams(tcfg)
    vocab = build_vocab(model_dir, int(hp.require("vocab_size")), options)
    with TensorSource(safetensors) as tensors:
        plan = plan_tensors(family, hp, tensors, outtype)
        writer = gguf.GGUFWriter(str(out_path), family.gguf_arch)
        started = False
        try:
            writer.add_name(name)
            writer.add_file_type(int(OUTTYPES[outtype][1]))
            if OUTTYPES[outtype][0] not in (Q.F32, Q.F16, Q.BF16):
                writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            family.write_hparams(writer, hp)
            write_vocab(writer, vocab, model_dir)
            for p in plan:
                byte_shape = gguf.quant_shape_to_byte_shape(p.shape, p.qtype) if p.qtype not in (Q.F32, Q.F16) else p.shape
                item = {Q.F32: 4, Q.F16: 2}.get(p.qtype, 1)
                nbytes = int(np.prod(byte_shape)) * item
                np_dtype = {Q.F32: np.float32, Q.F16: np.float16}.get(p.qtype, np.uint8)
                writer.add_tensor_info(p.gguf_name, byte_shape, np.dtype(np_dtype), nbytes,
                                       raw_dtype=None if p.qtype in (Q.F32, Q.F16) else p.qtype)
            started = True  # from here on out_path holds our partial output
            writer.write_header_to_file(path=str(out_path))
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            total = sum(tensors.info(p.hf_name).nbytes for p in plan if p.hf_name)
            with bar(total, f"gguf {outtype}") as pb:
                for p in plan:
                    if p.hf_name is None:
                        data = p.data
                    else:
                        data = tensors.float32(p.hf_name)
                        if p.rule is not None and p.rule.transform is not None:
                            data = p.rule.transform(data, hp)
                        pb.update(tensors.info(p.hf_name).nbytes)
                    bad = _nonfinite(data)
                    if bad:
                        size = data.size
                        del data  # may be a view of the mmap, which cannot close while a traceback holds it
                        raise ModelFormatError(f"{name}: tensor {p.hf_name or p.gguf_name} has {bad} non-finite value(s) "
                                               f"(NaN/Inf) out of {size}; refusing to convert corrupt weights")
                    encoded = _encode(data, p.qtype)
                    if p.qtype == Q.F16 and not np.isfinite(encoded).all():
                        # finite bf16/f32 values beyond float16's range (65504) would be written as +-Inf
                        peak = float(np.abs(data).max())
                        del data, encoded
                        raise ModelFormatError(f"{name}: tensor {p.hf_name or p.gguf_name} holds values up to {peak:.4g}, "
                                               "beyond float16's range (65504): use a bf16 or f32 recipe for this model")
                    writer.write_tensor_data(encoded)
                    del data, encoded
                    if p.hf_name is not None:
                        tensors.release(p.hf_name)
        except BaseException:
            # Never leave a half-written GGUF behind: a caller (or a later publish) could take it for a model.
            writer.close()
            if started:
                out_path.unlink(missing_ok=True)
            raise
        writer.close()
        return ConvertReport(
            architecture=arch, gguf_arch=family.gguf_arch, outtype=outtype, tensors=len(plan),
            tensor_types=dict(Counter(p.qtype.name for p in plan)), parameters=tensors.parameters,
            vocab=vocab.info,
        )
