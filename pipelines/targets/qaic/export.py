"""PyTorch -> ONNX for Cloud AI 100 (reference/ai100-qpc.md), without the model in memory.

The graph is the retained-state decoder (decoder.py) traced by torch's ONNX exporter over a model whose
parameters are placeholders (zero pages the kernel never backs) and left out of the trace
(`export_params=False`): the graph of a 70B model costs its nodes, not its weights. Then every parameter
streams from the safetensors files into one external-data file beside the model (`model.onnx.data`), a chunk of
rows at a time, through the folds torch's constant folding would have done on real weights (the transpose of
every linear weight, an expert's slice of stacked MoE weights, Gemma's 1 + w): the graph multiplies by
constant initializers, as the compiler needs for `-mxfp6-matmul`.

Precision (`weight_dtype`): matrices are stored in float16 by default, each behind a Cast to float32, so
the graph still computes in fp32 (onnxruntime runs it) and the file is half the fp32 copy QEfficient writes
(70B: 141 GB instead of 282 GB). The device computes in fp16 (`-convert-to-fp16` converts every fp32 tensor),
so fp16 storage loses nothing it would keep; a weight beyond float16's range is refused, as the device could
not hold it. Vectors (norms, biases) and RoPE tables stay fp32. `weight_dtype: float32` writes QEfficient's
layout (fp32 initializers, no Cast), for SDKs or tools that expect it.

Stored names are deterministic (the parameter's name plus the folds applied), so a graph of the first N
layers (`slice_graph`) points at the same bytes of the same data file: onnxruntime checks a slice of the
published export when the whole does not fit the budget.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...core.errors import ModelFormatError
from .decoder import build_decoder
from .external_data import DataWriter, Weights, stored_dtype, stored_initializers
from .families import FAMILY_SPECS, architecture, unsupported
from .layout import DEEPSTACK, KEEP_INPUT, RETAINED
from .plan import WEIGHT_DTYPES

OPSET = 17
FAMILIES = set(FAMILY_SPECS)
DATA_SUFFIX = ".data"

__all__ = ["OPSET", "FAMILIES", "ExportReport", "export", "export_decoder", "slice_graph", "stored_dtype",
           "build_decoder"]


@dataclass
class ExportReport:
    path: str
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    external_data: bool
    architecture: str = ""
    ctx_len: int = 0  # the cache length of the export sample (ctx_len stays a dynamic axis)
    batch_index: bool = False  # continuous batching: `batch_index` input, past inputs [full_batch_size, ...]
    logits_to_keep: bool = False  # speculative decoding's target LM: `num_logits_to_keep` input, logits [B, N, vocab]
    files: list[str] = field(default_factory=list)  # written, relative to the model's folder: publish all of them
    weight_dtype: str = "float16"
    data_bytes: int = 0
    initializers: int = 0
    clipped_to_fp16: int = 0  # weight values beyond float16's range, clipped to it (as QEfficient does)


def check_architecture(model_dir: Path) -> str:
    """The checkpoint's architecture from config.json, refused before any work when unsupported."""
    try:
        arch = architecture(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, ValueError, AttributeError) as e:
        raise ModelFormatError(f"cannot read config.json of {model_dir}: {e}") from None
    if arch not in FAMILIES:
        raise unsupported(arch)
    return arch


# -- the graph -----------------------------------------------------------------------------------------------

def placeholder_model(model_dir: Path, layers: int | None = None):
    """(the causal LM with zero-page placeholders for parameters, the checkpoint rule of each parameter, the
    checkpoint). Placeholders are calloc'd numpy zeros: never written, so never resident."""
    import torch

    from ...model.streamed_model import meta_model
    from ...model.unit_memory import return_freed_memory
    from ...source.checks import refuse_unused_tensors
    from ...source.safetensors_io import TensorSource

    return_freed_memory()  # large allocations are fresh mmaps: calloc leaves them untouched
    source = TensorSource(sorted(Path(model_dir).glob("*.safetensors")))
    model, rules = meta_model(Path(model_dir), set(source.names()), layers)
    if layers is None:  # the whole model: every checkpoint tensor must have found its parameter
        refuse_unused_tensors(source.names(), (s for rule in rules.values() for s in rule.sources))
    real: dict[int, Any] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in real:
                    real[id(p)] = torch.nn.Parameter(torch.from_numpy(np.zeros(tuple(p.shape), np.float32)),
                                                     requires_grad=False)
                module._parameters[name] = real[id(p)]
    return model, rules, source


@contextmanager
def _shape_inference_without_values() -> Iterator[None]:
    """torch's exporter infers shapes with the parameters' values, computing every folded weight for real (the
    whole model in memory, minutes at scale); without them it infers the same shapes from the traced types."""
    import torch

    original = torch._C._jit_pass_onnx_graph_shape_type_inference
    torch._C._jit_pass_onnx_graph_shape_type_inference = lambda graph, _params, opset: original(graph, {}, opset)
    try:
        yield
    finally:
        torch._C._jit_pass_onnx_graph_shape_type_inference = original


def trace_graph(decoder, ctx_len: int):
    """The decoder's ONNX graph with every parameter a graph input named by its path in the decoder."""
    import onnx
    import torch

    layers, n_kv, head_dim, batch_index = len(decoder.layers), decoder.n_kv, decoder.head_dim, decoder.batch_index
    keep = decoder.logits_to_keep
    names_in = ["input_ids", "position_ids"] + [f"past_{kv}.{i}" for i in range(layers) for kv in ("key", "value")]
    names_out = ["logits"] + [f"past_{kv}.{i}_RetainedState" for i in range(layers) for kv in ("key", "value")]
    bsz, full, seq = (2, 3, 4) if batch_index else (1, 1, 4)
    sample = [torch.zeros(bsz, seq, dtype=torch.long), torch.arange(seq).repeat(bsz, 1),
              *[torch.zeros(full, n_kv, ctx_len, head_dim) for _ in range(2 * layers)]]
    cache_axes = {0: "full_batch_size" if batch_index else "batch_size", 2: "ctx_len"}
    axes: dict[str, dict[int, str]] = {"input_ids": {0: "batch_size", 1: "seq_len"},
                                       "position_ids": {0: "batch_size", 1: "seq_len"}, "logits": {0: "batch_size"}}
    for name in names_in[2:] + names_out[1:]:
        axes[name] = dict(cache_axes)
    if decoder.position_rows is not None:  # multimodal RoPE: position_ids [rows, batch, seq] (row 0 text)
        sample[1] = sample[1].expand(decoder.position_rows, -1, -1).contiguous()
        axes["position_ids"] = {1: "batch_size", 2: "seq_len"}
    if batch_index:
        names_in.append("batch_index")
        sample.append(torch.tensor([[2], [0]]))
        axes["batch_index"] = {0: "batch_size"}
    if keep:  # only its length is read: the number of positions whose logits the graph returns
        names_in.append(KEEP_INPUT)
        sample.append(torch.zeros(3, 1, dtype=torch.long))
        axes[KEEP_INPUT] = {0: KEEP_INPUT}
        axes["logits"] = {0: "batch_size", 1: KEEP_INPUT}
    if decoder.image_token is not None:  # a VLM's language graph (QEfficient's names and order)
        names_in[1:1] = ["vision_embeds"]
        names_in[3:3] = ["image_idx"]
        names_out[1:1] = [f"vision_embeds{RETAINED}", "image_idx_output"]
        sample[1:1] = [torch.zeros(1, 8, decoder.embed.weight.shape[1])]
        sample[3:3] = [torch.zeros(1, 1, dtype=torch.long)]
        axes["vision_embeds"] = axes[f"vision_embeds{RETAINED}"] = {0: "vision_batch_size", 1: "vision_size"}
        if decoder.deepstack:  # QEfficient's Qwen3-VL: the DeepStack features right after vision_embeds
            names_in[2:2], names_out[2:2] = [DEEPSTACK], [f"{DEEPSTACK}{RETAINED}"]
            sample[2:2] = [torch.zeros(decoder.deepstack, 1, 8, decoder.embed.weight.shape[1])]
            axes[DEEPSTACK] = axes[f"{DEEPSTACK}{RETAINED}"] = {1: "vision_batch_size", 2: "vision_size"}
    if decoder.cross_grid is not None:  # a cross-attention VLM: the tile mask, and each cross layer's image K/V
        tiles, rows = decoder.cross_grid
        names_in[1:1] = ["cross_attention_mask"]
        sample[1:1] = [torch.ones(bsz, seq, 1, tiles, dtype=torch.long)]
        axes["cross_attention_mask"] = {0: "batch_size", 1: "seq_len", 2: "max_num_images"}
        for i in decoder.cross_layers:
            for kv in ("key", "value"):
                sample[names_in.index(f"past_{kv}.{i}")] = torch.zeros(full, n_kv, tiles * rows, head_dim)
                axes[f"past_{kv}.{i}"] = axes[f"past_{kv}.{i}{RETAINED}"] = {0: cache_axes[0]}
    buf = io.BytesIO()
    with torch.no_grad(), _shape_inference_without_values():
        torch.onnx.export(decoder, tuple(sample), buf, input_names=names_in, output_names=names_out,
                          dynamic_axes=axes, opset_version=OPSET, do_constant_folding=False, dynamo=False,
                          export_params=False, keep_initializers_as_inputs=True)
    return onnx.load_from_string(buf.getvalue()), names_in


def _report(decoder, out_path: Path, ctx_len: int, writer: DataWriter, n_inits: int, weight_dtype: str) -> ExportReport:
    return ExportReport(str(out_path), len(decoder.layers), decoder.n_kv, decoder.head_dim, decoder.vocab,
                        decoder.max_positions, True, architecture=decoder.arch, ctx_len=ctx_len,
                        batch_index=decoder.batch_index, logits_to_keep=decoder.logits_to_keep,
                        files=[out_path.name, out_path.name + DATA_SUFFIX],
                        weight_dtype=weight_dtype, data_bytes=writer.offset, initializers=n_inits,
                        clipped_to_fp16=writer.clipped)


def _write(model, decoder, weights: Weights, out_path: Path, ctx_len: int, weight_dtype: str) -> ExportReport:
    import onnx

    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    data_path = out_path.with_name(out_path.name + DATA_SUFFIX)
    for stale in (out_path, data_path):
        stale.unlink(missing_ok=True)
    writer = DataWriter(data_path)
    try:
        n = stored_initializers(model, decoder, weights, writer=writer, weight_dtype=weight_dtype)
        writer.close()
        model.producer_name = "hive-aot"
        onnx.save_model(model, str(out_path))
    except BaseException:
        writer.close()
        for partial in (out_path, data_path):
            partial.unlink(missing_ok=True)
        raise
    return _report(decoder, out_path, ctx_len, writer, n, weight_dtype)


def export(model_dir: Path, out_path: Path, *, ctx_len: int = 128, batch_index: bool = False,
           weight_dtype: str = "float16", logits_to_keep: bool = False) -> ExportReport:
    """Export a checkpoint of a supported family to `out_path` and `<out_path>.data`, streamed from its
    safetensors (memory: the graph and a few chunks). Refuses other architectures (NotApplicableError).
    `logits_to_keep`: the target LM of speculative decoding (decoder.py), an export of its own."""
    check_architecture(model_dir)
    model, rules, source = placeholder_model(model_dir)
    try:
        decoder = build_decoder(model, batch_index=batch_index, ctx_len=ctx_len, logits_to_keep=logits_to_keep)
        graph, _names = trace_graph(decoder, ctx_len)
        return _write(graph, decoder, Weights(decoder, model, rules, source), out_path, ctx_len, weight_dtype)
    finally:
        source.close()


def export_decoder(decoder, out_path: Path, *, ctx_len: int = 128, weight_dtype: str = "float16") -> ExportReport:
    """Export a `build_decoder` module over a model in memory (its own weights)."""
    graph, _names = trace_graph(decoder, ctx_len)
    return _write(graph, decoder, Weights(decoder), out_path, ctx_len, weight_dtype)


def export_placeholder_decoder(decoder, model, rules, source, out_path: Path, *, ctx_len: int = 128,
                               weight_dtype: str = "float16") -> ExportReport:
    """Export a `build_decoder` module over a `placeholder_model` (its weights streamed from the checkpoint)."""
    graph, _names = trace_graph(decoder, ctx_len)
    return _write(graph, decoder, Weights(decoder, model, rules, source), out_path, ctx_len, weight_dtype)


def slice_graph(model_dir: Path, onnx_path: Path, layers: int, out_path: Path, decoder_of=None) -> Path:
    """A graph of the first `layers` layers over the external data of the export at `onnx_path` (no byte is
    copied): written to `out_path`, which must be in the same directory. `decoder_of(model, batch_index,
    logits_to_keep)`: the decoder of the placeholder model (default: build_decoder's; a VLM's language decoder)."""
    import onnx

    full = onnx.load(str(onnx_path), load_external_data=False)
    lookup = {t.name: t for t in full.graph.initializer}
    batch_index = any(i.name == "batch_index" for i in full.graph.input)
    keep = any(i.name == KEEP_INPUT for i in full.graph.input)
    model, rules, source = placeholder_model(model_dir, layers=layers)
    try:
        if decoder_of is None:
            decoder = build_decoder(model, batch_index=batch_index, ctx_len=16, logits_to_keep=keep)
        else:
            decoder = decoder_of(model, batch_index, keep)
        graph, _names = trace_graph(decoder, 16)
        stored_initializers(graph, decoder, Weights(decoder, model, rules, source), lookup=lookup)
    finally:
        source.close()
    if Path(out_path).parent.resolve() != Path(onnx_path).parent.resolve():
        raise ValueError("a slice's graph lives beside the export whose data it reads")
    onnx.save_model(graph, str(out_path))
    return Path(out_path)
