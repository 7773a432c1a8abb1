"""The streaming HF -> GGUF engine: plan every tensor from headers, write metadata, then stream.

A family (`families/<name>.py`) declares rules (HF tensors -> GGUF tensors through a transform); this
engine expands them per block and per expert, computes every output shape from the safetensors headers
(so the GGUF header is written before any tensor data is read), then runs the rules one at a time.
Peak memory is one rule's tensors in float32 for whole-tensor transforms (a fused qkv, a Q permutation)
and a 16 MiB row slice for the rest: embeddings, MLP matrices and stacked experts are read, widened,
encoded and written slice by slice through the mmap (a tensor copied as stored skips the widening:
direct.py). A tensor with NaN/Inf values is refused as it streams by, and a refused conversion leaves no
partial file behind.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ...core.errors import ModelFormatError
from ...core.progress import bar
from ...source.safetensors_io import TensorSource
from .direct import encoder as direct_encoder
from .families import Family, HParams, Rule, family_for, is_ignored
from .families.spec import IDENTITY as _IDENTITY
from .ftypes import FTYPES
from .kv_writer import GGUFWriter, add_key_value, general_metadata
from .sliced import file_type, reads_quantization, write_sliced
from .tensor_quant import NUMPY_TYPES, apply as assign_quantized_types, quantize_rows, round_to
from .tensor_writer import Layout, TensorWriter, encode_threads, in_order, llama_cpp_order
from .vocab import build_vocab, write_vocab

Q = gguf.GGMLQuantizationType
F = gguf.LlamaFileType

# outtype -> (tensor type for 2-D weights, general.file_type)
OUTTYPES: dict[str, tuple[Q, F]] = {
    "f32": (Q.F32, F.ALL_F32),
    "f16": (Q.F16, F.MOSTLY_F16),
    "bf16": (Q.BF16, F.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0),
    # gguf-py's numpy quantizers: the same bytes as ggml's reference quantization (no imatrix). The output
    # matrix is kept at q8_0 (OUTPUT_KEPT), as llama.cpp's quantizer keeps it at Q6_K: in 4-5 bits it costs
    # most of the quality (measured on the demo model, tied embeddings: q4_0 everywhere KL 0.40)
    "q4_0": (Q.Q4_0, F.MOSTLY_Q4_0),
    "q4_1": (Q.Q4_1, F.MOSTLY_Q4_1),
    "q5_0": (Q.Q5_0, F.MOSTLY_Q5_0),
    "q5_1": (Q.Q5_1, F.MOSTLY_Q5_1),
}
SLICE_BYTES = 16 << 20  # float32 bytes per streamed row slice
OUTPUT_KEPT = {Q.Q4_0: Q.Q8_0, Q.Q4_1: Q.Q8_0, Q.Q5_0: Q.Q8_0, Q.Q5_1: Q.Q8_0}


@dataclass
class Output:
    name: str
    shape: tuple[int, ...]
    qtype: Q
    lossless: Q | None = None  # quantized straight from the source: the type the intermediate would have had
    fixed: bool = False  # its rule fixes the type whatever the outtype (MXFP4 experts): never a fallback


@dataclass
class Step:
    """One rule applied to one block: its expanded HF inputs and planned GGUF outputs."""

    rule: Rule | None  # None: a tensor the family computes (rope_freqs), in `data`
    inputs: list[str]
    outputs: list[Output]
    data: np.ndarray | None = None
    source_bytes: int = 0


@dataclass
class ConvertReport:
    architecture: str
    gguf_arch: str
    family: str
    outtype: str
    tensors: int
    tensor_types: dict[str, int]
    parameters: int
    vocab: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)  # "Q4_0->F16": matrices whose rows are not whole blocks
    files: list[str] = field(default_factory=list)  # the file, or its shards in order
    quantization: dict[str, Any] | None = None  # written as a k-quant (ftype): the quantizer's summary


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A nested text config wins (multimodal wrappers); fold the outer architectures in. The outer ones name the
    wrapper, which is what a family declares: a text config may name its base model's (llava-1.5's Llama)."""
    tc = cfg.get("text_config")
    if isinstance(tc, dict):
        # the vision config rides along: some language-model keys come from it (Qwen3-VL's deepstack layer count)
        vision = {"vision_config": cfg["vision_config"]} if isinstance(cfg.get("vision_config"), dict) else {}
        # transformers 5 ties a wrapper's embeddings by the outer config's value (a Qwen3-VL-MoE's untied head)
        tie = {"tie_word_embeddings": cfg["tie_word_embeddings"]} if cfg.get("tie_word_embeddings") is not None else {}
        return {**vision, **tc, **tie, "architectures": cfg.get("architectures") or tc.get("architectures")}
    return cfg


# Matrices llama.cpp keeps in f32 in every file type (its converter and quantizer alike): MoE routers, whose top-k
# choice flips at near-ties when rounded (measured: a random Mixtral's q8_0 router, KL 0.031 vs 0.0004), learned
# position / token-type embeddings, every tensor not named `.weight` (biases, Mamba-2's [heads, 1] `ssm_a`) and the
# recurrent layers' short convolutions (Mamba, the gated delta-net, LFM2), which libllama never quantizes.
ALWAYS_F32 = re.compile(r"(blk\.\d+\.(ffn_gate_inp(_shexp)?|ssm_conv1d|shortconv\.conv)|position_embd|token_types)\.weight"
                        r"|(?!.*\.weight$).+")


def tensor_type(shape: tuple[int, ...], outtype: str, name: str = "") -> Q:
    if len(shape) <= 1 or name.endswith("_norm.weight") or ALWAYS_F32.fullmatch(name):
        return Q.F32  # norms (per-head ones are 2-D) and biases stay f32 in every llama.cpp file type
    qtype = OUTTYPES[outtype][0]
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return Q.F16  # rows that are not whole blocks fall back, as llama.cpp does (recorded in the report)
    return qtype


_PER_INPUT = {"{xid}": lambda hp: hp.n_experts, "{hid}": lambda hp: hp.n_head, "{kvid}": lambda hp: hp.n_head_kv}


def _expand(names: tuple[str, ...], bid: int | None, hp: HParams) -> list[str]:
    out: list[str] = []
    for n in names:
        n = n.replace("{bid}", str(bid)) if bid is not None else n
        # {xid}: one input per expert; {hid} / {kvid}: one per query / key head (per-head norms, StableLM)
        key = next((k for k in _PER_INPUT if k in n), None)
        out += [n.replace(key, str(x)) for x in range(_PER_INPUT[key](hp))] if key else [n]
    return out


def plan_tensors(family: Family, hp: HParams, tensors: TensorSource, outtype: str) -> list[Step]:
    plan: list[Step] = []
    used: set[str] = set()
    tied = bool(hp.get("tie_word_embeddings", family.tied_default))

    def take(rule: Rule, bid: int | None) -> None:
        if rule.when is not None and bid is not None and not rule.when(hp, bid):
            return
        inputs = [family.located(n, tensors.__contains__) for n in _expand(rule.inputs, bid, hp)]
        outputs = [o.replace("{bid}", str(bid)) for o in rule.outputs]
        missing = [n for n in inputs if n not in tensors]
        if missing:
            if rule.optional and len(missing) == len(inputs):
                return
            raise ModelFormatError(f"missing tensor {missing[0]!r} for {family.name} (needed for {outputs[0]})")
        used.update(inputs)
        if tied and family.tied_output is not None and inputs == [family.located(family.tied_output, tensors.__contains__)]:
            return  # tied: llama.cpp reuses token_embd; an identical lm_head copy is dropped
        in_shapes = [tuple(tensors.info(n).shape) for n in inputs]
        if rule.transform.stack and len(set(in_shapes)) > 1:
            raise ModelFormatError(f"{family.name}: the experts of {outputs[0]} differ in shape ({sorted(set(in_shapes))})")
        try:
            out_shapes = rule.transform.shapes(in_shapes, hp)
        except ModelFormatError as e:
            raise ModelFormatError(f"{inputs[0]}: {e}") from None
        if len(out_shapes) != len(outputs):
            raise ModelFormatError(f"{family.name}: rule for {outputs} makes {len(out_shapes)} tensors")
        fixed = rule.transform.fixed  # the checkpoint's type kept (MXFP4 experts), else the outtype's
        plan.append(Step(rule, inputs, [Output(n, s, fixed if fixed is not None else tensor_type(s, outtype, n),
                                               fixed=fixed is not None) for n, s in zip(outputs, out_shapes)],
                         source_bytes=sum(tensors.info(n).nbytes for n in inputs)))

    for rule in family.tensors:
        if not rule.per_block:
            take(rule, None)
    if not tied and family.tied_output is not None and family.located(family.tied_output, tensors.__contains__) not in tensors:
        raise ModelFormatError(f"{family.tied_output} is missing and tie_word_embeddings is false")
    for bid in range(family.blocks(hp) if family.blocks is not None else hp.n_layers):  # NextN layers after the trunk
        for rule in family.tensors:
            if rule.per_block:
                take(rule, bid)
    used.update(n for names in family.key_tensors(hp, tensors.__contains__).values() for n in names)  # read as keys
    for name, data in family.extra_tensors(hp).items():
        plan.append(Step(None, [], [Output(name, tuple(data.shape), Q.F32)], data))
    _keep_output(plan, OUTTYPES[outtype][0])
    leftover = sorted(n for n in tensors if n not in used and not is_ignored(family, n)
                      and not (family.unused is not None and family.unused(hp, n)))
    if leftover:
        more = f" and {len(leftover) - 3} more" if len(leftover) > 3 else ""
        raise ModelFormatError(f"unmapped tensors for {family.name}: {', '.join(leftover[:3])}{more}")
    _check_shapes(plan, hp, family.query_gate, family.query_head_dim)
    return plan


def _keep_output(plan: list[Step], wanted: Q) -> None:
    """The output projection (token_embd when tied) at OUTPUT_KEPT's type for the legacy 4-5 bit outtypes."""
    if wanted not in OUTPUT_KEPT:
        return
    outs = {o.name: o for step in plan for o in step.outputs}
    head = outs.get("output.weight") or outs.get("token_embd.weight")
    if head is not None and head.qtype == wanted:
        head.qtype = OUTPUT_KEPT[wanted]


def _check_shapes(plan: list[Step], hp: HParams, query_gate: bool = False, query_head_dim=None) -> None:
    hidden, vocab = hp.hidden, int(hp.require("vocab_size"))
    q_dim = query_head_dim(hp) if query_head_dim is not None else hp.head_dim
    expect = {
        r"token_embd\.weight": (vocab, hidden),
        # a gated query (Qwen3-Next) holds each head's output gate beside its query: twice the rows
        r"blk\.\d+\.attn_q\.weight": (hp.n_head * q_dim * (2 if query_gate else 1), hidden),
        r"blk\.\d+\.attn_k\.weight": (hp.n_head_kv * hp.head_dim, hidden),
    }
    for step in plan:
        for out in step.outputs:
            for pattern, shape in expect.items():
                if re.fullmatch(pattern, out.name) and out.shape != shape:
                    what = step.inputs[0] if step.inputs else out.name
                    if out.name == "token_embd.weight":
                        raise ModelFormatError(f"embedding is {list(out.shape)}, config says vocab_size={vocab}, "
                                               f"hidden_size={hidden}")
                    raise ModelFormatError(f"{what} is {list(out.shape)}, config implies {list(shape)}")


def _encode(data: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F16:
        with np.errstate(over="ignore"):  # overflow to Inf is detected (and refused) by the caller
            return np.ascontiguousarray(data, dtype=np.float16)
    if qtype.name not in NUMPY_TYPES:  # k-quants: ggml's own quantizer
        return quantize_rows(data, qtype)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def _nonfinite(data: np.ndarray) -> int:
    """How many NaN/Inf values a tensor holds: numerical validation only sees the rows its prompts touch.

    The boolean mask is a quarter of the float32 tensor already in hand and is freed before the encoded copy
    is made, so the converter's peak memory does not grow; counting runs only on the failure path.
    """
    if np.isfinite(data).all():
        return 0
    return int(data.size - np.count_nonzero(np.isfinite(data)))


def _row_slices(rows: int, row_floats: int) -> Iterator[tuple[int, int]]:
    step = max(1, SLICE_BYTES // max(1, 4 * row_floats))
    for lo in range(0, rows, step):
        yield lo, min(rows, lo + step)


def _checked(data: np.ndarray, out: Output, what: str, model: str) -> np.ndarray:
    """One slice of an output tensor, checked and encoded to its GGUF type."""
    bad = _nonfinite(data)
    if bad:
        # counted in the slice at hand (the first bad one): the rest of the tensor is not read
        raise ModelFormatError(f"{model}: tensor {what} has {bad} non-finite value(s) (NaN/Inf) out of "
                               f"{int(np.prod(out.shape))}; refusing to convert corrupt weights")
    if out.lossless is not None and out.qtype != out.lossless:
        data = round_to(data, out.lossless)
        if out.lossless == Q.F16 and not np.isfinite(data).all():  # as the f16 intermediate would have refused it
            raise ModelFormatError(f"{model}: tensor {what} holds values beyond float16's range (65504): use a bf16 "
                                   "or f32 source for this model")
    encoded = _encode(data, out.qtype)
    if out.qtype == Q.F16 and not np.isfinite(encoded).all():
        # finite bf16/f32 values beyond float16's range (65504) would be written as +-Inf
        raise ModelFormatError(f"{model}: tensor {what} holds values up to {float(np.abs(data).max()):.4g}, "
                               "beyond float16's range (65504): use a bf16 or f32 recipe for this model")
    return encoded


def _stream_rows(tensors: TensorSource, hf: str, transform, hp: HParams, sink: TensorWriter, out: Output,
                 model: str, pb) -> None:
    """A rowwise transform (or one expert of a stack) through 16 MiB row slices of the mapped source, read,
    widened and encoded on worker threads, written here in order. A tensor copied as stored is cast straight
    from its bytes (direct.py); a slice that cast refuses takes this general path, which says why."""
    info = tensors.info(hf)
    rows = info.shape[0] if info.shape else 1
    row_bytes = info.nbytes // rows if rows else 0
    row_floats = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else 1
    copied = transform is _IDENTITY and out.lossless in (None, out.qtype) and info.shape
    direct = direct_encoder(info.dtype, out.qtype) if copied else None

    def job(lo: int, hi: int):
        def run():
            encoded = direct(tensors.raw_rows(hf, lo, hi)) if direct is not None else None
            if encoded is not None:
                return encoded, lo, hi
            data = tensors.rows(hf, lo, hi) if info.shape else tensors.float32(hf).reshape(1)
            encoded = _checked(transform.apply([data], hp)[0], out, hf, model)
            del data  # may be a view of the mmap: gone before its pages are dropped
            return encoded, lo, hi
        return run

    def write(result) -> None:
        encoded, lo, hi = result
        sink.write(encoded)
        tensors.release(hf, lo * row_bytes, hi * row_bytes)
        pb.update((hi - lo) * row_bytes)

    in_order((job(lo, hi) for lo, hi in _row_slices(rows, row_floats)), write, encode_threads())


def _write_step(step: Step, tensors: TensorSource, hp: HParams, writer: gguf.GGUFWriter, model: str, pb,
                layout: Layout | None = None) -> None:
    rule = step.rule
    if rule is not None and (rule.transform.sliced or rule.transform.fixed is not None):  # expert by expert
        return write_sliced(step, tensors, hp, TensorWriter(writer, step.outputs[0], layout), pb, SLICE_BYTES,
                            lambda data: _checked(data, step.outputs[0], step.inputs[0], model))
    if rule is None:  # computed by the family
        sink = TensorWriter(writer, step.outputs[0], layout)
        sink.write(_checked(step.data, step.outputs[0], step.outputs[0].name, model))
        sink.close()
        return
    if rule.transform.rowwise or rule.transform.stack:
        sink = TensorWriter(writer, step.outputs[0], layout)
        identity = rule.transform if rule.transform.rowwise else _IDENTITY
        for hf in step.inputs:  # a stack is its experts one after the other
            _stream_rows(tensors, hf, identity, hp, sink, step.outputs[0], model, pb)
        sink.close()
        return
    arrays = [tensors.float32(n) for n in step.inputs]
    results = rule.transform.apply(arrays, hp)
    del arrays
    for out, data in zip(step.outputs, results):
        if tuple(data.shape) != out.shape:
            raise RuntimeError(f"{rule.transform.name} made {out.name} {list(data.shape)}, planned {list(out.shape)}")
        sink = TensorWriter(writer, out, layout)
        if data.ndim <= 1:
            sink.write(_checked(data, out, step.inputs[0], model))
        else:  # encoded slice by slice: never a second whole copy
            flat = data.reshape(-1, data.shape[-1])
            in_order((lambda lo=lo, hi=hi: _checked(flat[lo:hi], out, step.inputs[0], model)
                       for lo, hi in _row_slices(flat.shape[0], flat.shape[-1])), sink.write, encode_threads())
        sink.close()
    del results
    for n in step.inputs:
        tensors.release(n)
    pb.update(step.source_bytes)


def convert(model_dir: Path, cfg: dict[str, Any], safetensors: list[Path], out_path: Path, outtype: str,
            *, name: str, options: dict[str, Any] | None = None,
            provenance: dict[str, str] | None = None, split_max_bytes: int = 0, ftype: str | None = None) -> ConvertReport:
    """HF safetensors -> one GGUF file, or llama.cpp-loadable shards `<stem>-0000i-of-0000n.gguf` of at most
    `split_max_bytes` of tensor data each (the report's `files`; llama.cpp loads them all from the first).
    `provenance` (source commit, build id) is written as `hive_aot.*` keys. `ftype` (a llama.cpp file type,
    Q4_K_M): each tensor quantized as it streams, to what libllama's quantizer makes of `outtype`, the source's
    lossless type (tensor_quant.py)."""
    if outtype not in OUTTYPES:
        raise ModelFormatError(f"GGUF outtype {outtype!r} is not written directly (use one of {', '.join(OUTTYPES)})")
    options = options or {}
    tcfg = text_config(cfg)
    arch = (tcfg.get("architectures") or [None])[0]
    quant = cfg.get("quantization_config") if cfg.get("quantization_config") is not None else tcfg.get("quantization_config")
    if quant is not None and not reads_quantization(arch, quant):
        # Pre-quantized weights (GPTQ/AWQ/FP8 ... or a garbage entry) would be read here as if they were plain
        # floats and published as an unquantized model; `check` keeps the GGUF recipes off such models too.
        # Only a family whose rules read that quantization's tensors as stored takes it (gpt-oss's MXFP4 experts).
        raise ModelFormatError(f"{name}: config.json has a quantization_config; the GGUF converter reads only "
                               "unquantized float weights")
    hp = HParams(tcfg)
    family = family_for(arch).for_config(hp)  # a config may be written as another arch
    key_values = family.key_values(hp)
    vocab = build_vocab(model_dir, int(hp.require("vocab_size")), options)
    with TensorSource(safetensors) as tensors:
        plan = plan_tensors(family, hp, tensors, outtype)
        key_values.update(family.tensor_key_values(hp, tensors.__contains__, tensors.float32))
        outputs = [o for step in plan for o in step.outputs]
        quantization = assign_quantized_types(outputs, family.gguf_arch, key_values, ftype,
                                              FTYPES[ftype.upper()], name) if ftype else None
        writer = GGUFWriter(str(out_path), family.gguf_arch, split_max_size=split_max_bytes)
        started = False
        try:
            # A k-quant is laid out as libllama's quantizer lays it out; its tensors are still written in the
            # plan's order (the one that streams), each at its offset.
            for o in sorted(outputs, key=lambda o: llama_cpp_order(o.name)) if ftype else outputs:
                raw = o.qtype not in (Q.F32, Q.F16)
                byte_shape = gguf.quant_shape_to_byte_shape(o.shape, o.qtype) if raw else o.shape
                nbytes = int(np.prod(byte_shape)) * {Q.F32: 4, Q.F16: 2}.get(o.qtype, 1)
                np_dtype = {Q.F32: np.float32, Q.F16: np.float16}.get(o.qtype, np.uint8)
                writer.add_tensor_info(o.name, byte_shape, np.dtype(np_dtype), nbytes, raw_dtype=o.qtype if raw else None)
            general = general_metadata(writer, model_dir, name)
            for key, (value, kind) in key_values.items():
                add_key_value(writer, key, value, kind)
            if not ftype:
                writer.add_file_type(int(file_type(outtype, OUTTYPES[outtype][1], outputs)))
                writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            write_vocab(writer, vocab, model_dir)
            for key, value in sorted((provenance or {}).items()):
                writer.add_string(f"hive_aot.{key}", value)
            if ftype:  # where libllama's quantizer puts them: last
                writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
                writer.add_file_type(FTYPES[ftype.upper()])
            started = True  # from here on out_path holds our partial output
            writer.write_header_to_file(path=out_path)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            layout = Layout(writer) if ftype else None
            total = sum(step.source_bytes for step in plan)
            with bar(total, f"gguf {outtype}") as pb:
                for step in plan:
                    _write_step(step, tensors, hp, writer, name, pb, layout)
        except BaseException:
            # Never leave a half-written GGUF behind: a caller (or a later publish) could take it for a model.
            writer.close()
            if started:
                for path in writer.format_shard_names(out_path):
                    path.unlink(missing_ok=True)
            raise
        writer.close()
        files = [p.name for p in writer.format_shard_names(out_path)]
        return ConvertReport(
            architecture=arch, gguf_arch=family.gguf_arch, family=family.name, outtype=outtype, tensors=len(outputs),
            tensor_types=dict(Counter(o.qtype.name for o in outputs)), parameters=tensors.parameters,
            vocab=vocab.info, metadata=general,
            fallbacks={} if ftype else _fallbacks(outputs, OUTTYPES[outtype][0]), files=files,
            quantization=quantization,
        )


def _fallbacks(outputs: list[Output], wanted: Q) -> dict[str, int]:
    counts = Counter(f"{wanted.name}->{o.qtype.name}" for o in outputs
                     if len(o.shape) > 1 and not o.fixed and o.qtype not in (wanted, OUTPUT_KEPT.get(wanted))
                     and not (o.qtype == Q.F32 and o.name.endswith(".bias")))  # biases are f32 by rule, not by fallback
    return dict(sorted(counts.items()))
