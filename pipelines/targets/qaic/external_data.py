"""The export's external data: every stored value (folds.py) written into one file beside the model, a block of
rows at a time, page-aligned, in its stored precision, and described by ONNX TensorProtos.

A parameter that is one checkpoint tensor as stored streams from the mmap'd safetensors (rows, or columns for a
transposed weight); anything else (stacked MoE experts, a remote-code layout translated by native.py) is made
whole by its weight rule, folded, then written. fp16 values (matrices, when `weight_dtype` is float16) are read
through a Cast to float32 named as the value, so the graph's consumers are unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ...core.errors import ModelFormatError
from .folds import Stored, apply_node, attrs, const_value, fold_plan, shape_of

CHUNK_BYTES = 64 << 20  # fp32 bytes of a weight converted at a time (plan.EXPORT_CHUNK_BYTES)
DATA_ALIGN = 4096  # every tensor starts page-aligned in the data file (onnxruntime can map it)
FP16_MAX = 65504.0
INLINE_CONSTANT_BYTES = 1 << 20  # constants the trace embedded (RoPE tables) move to the data file beyond this


def stored_dtype(ndim: int, weight_dtype: str) -> str:
    """The precision a value of `ndim` dimensions is stored in: matrices at `weight_dtype`, vectors fp32."""
    return "float16" if weight_dtype == "float16" and ndim >= 2 else "float32"


class Weights:
    """The decoder's parameters by graph name: from the checkpoint (streamed; a parameter that is one checkpoint
    tensor as stored is read a chunk at a time) or, for a decoder over a model in memory, its own tensors."""

    def __init__(self, decoder, model=None, rules=None, source=None):
        self.decoder, self.rules, self.source = decoder, rules, source
        model_names: dict[int, str] = {}
        for n, p in (model or decoder).named_parameters(remove_duplicate=False):
            model_names.setdefault(id(p), n)
        self.params = {n: p for n, p in decoder.named_parameters(remove_duplicate=False)}
        self.model_name = {n: model_names.get(id(p), n) for n, p in self.params.items()}
        self.buffers = dict(decoder.named_buffers())

    def names(self) -> set[str]:
        return set(self.params) | set(self.buffers)

    def shape(self, name: str) -> tuple[int, ...]:
        t = self.params.get(name, self.buffers.get(name))
        return tuple(t.shape)

    def stored_view(self, name: str) -> tuple[np.ndarray, str] | None:
        """(a typed view of the checkpoint bytes in the parameter's shape, its safetensors dtype) when the
        parameter is one checkpoint tensor as stored; None otherwise."""
        if self.rules is None or name not in self.params:
            return None
        rule = self.rules[self.model_name[name]]
        if rule.combine is not None or len(rule.sources) != 1:
            return None
        info = self.source.info(rule.sources[0])
        view = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}.get(info.dtype)
        if view is None or tuple(info.shape) != self.shape(name):
            return None
        raw = self.source.where[rule.sources[0]].raw(rule.sources[0])
        return raw.view(view).reshape(info.shape), info.dtype

    def full(self, name: str) -> np.ndarray:
        """The whole parameter (or buffer) in float32."""
        if name in self.buffers:
            return self.buffers[name].detach().float().numpy()
        if self.rules is None:
            return self.params[name].detach().float().numpy()
        from ...model.streamed_model import read_float32

        return self.rules[self.model_name[name]].load(lambda s: read_float32(self.source, s)).numpy()

    def release(self, name: str) -> None:
        if self.rules is not None and name in self.params:
            for s in self.rules[self.model_name[name]].sources:
                self.source.release(s)


def _widen(part: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (part.astype(np.uint32) << 16).view(np.float32)
    return part.astype(np.float32)


def _chunks(st: Stored, weights: Weights, consts: dict[str, np.ndarray]) -> Iterator[np.ndarray]:
    """The stored value in float32, a block of rows at a time (rows of the result, in order)."""
    view = weights.stored_view(st.param)
    transpose = len(st.chain) == 1 and st.chain[0].op_type == "Transpose" and \
        list(attrs(st.chain[0]).get("perm", [])) == [1, 0]
    if view is not None and not st.chain and view[0].ndim >= 1:
        data, dtype = view
        per_row = max(1, data[0].size if data.ndim > 1 else 1) * 4
        step = max(1, CHUNK_BYTES // per_row)
        for lo in range(0, data.shape[0], step):
            yield _widen(data[lo:lo + step], dtype)
    elif view is not None and transpose and view[0].ndim == 2:
        data, dtype = view  # out = data.T: rows of the result are columns of the stored tensor
        step = max(1, CHUNK_BYTES // (data.shape[0] * 4))
        for lo in range(0, data.shape[1], step):
            yield np.ascontiguousarray(_widen(data[:, lo:lo + step], dtype).T)
    else:
        x = weights.full(st.param)
        for node in st.chain:
            x = apply_node(node, x, consts)
        x = np.ascontiguousarray(x, dtype=np.float32)
        step = max(1, CHUNK_BYTES // max(4, x[0].nbytes if x.ndim > 1 else 4))
        for lo in range(0, x.shape[0] if x.ndim else 1, step):
            yield x[lo:lo + step] if x.ndim else x.reshape(1)
    weights.release(st.param)


class DataWriter:
    """Tensors appended to the external-data file, each page-aligned, described by ONNX TensorProtos."""

    def __init__(self, path: Path):
        self.path, self.f, self.offset, self.clipped = path, open(path, "wb"), 0, 0

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str, chunks: Iterator[np.ndarray], what: str):
        import onnx

        pad = -self.offset % DATA_ALIGN
        self.f.write(b"\0" * pad)
        start = self.offset = self.offset + pad
        np_dtype = np.float16 if dtype == "float16" else np.float32
        for part in chunks:
            if not np.isfinite(part).all():
                raise ModelFormatError(f"{what} holds NaN/Inf values: refusing to export a broken model")
            if np_dtype is np.float16:
                over = np.abs(part) > FP16_MAX
                if over.any():  # the device computes in fp16: as QEfficient, clip to its range (reported)
                    self.clipped += int(over.sum())
                    part = np.clip(part, -FP16_MAX, FP16_MAX)
            data = np.ascontiguousarray(part, dtype=np_dtype)
            self.f.write(memoryview(data).cast("B"))
            self.offset += data.nbytes
        t = onnx.TensorProto()
        t.name = name
        t.dims.extend(shape)
        t.data_type = onnx.TensorProto.FLOAT16 if dtype == "float16" else onnx.TensorProto.FLOAT
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(start)), ("length", str(self.offset - start))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        if self.offset - start != expected:  # a checkpoint whose tensor shapes disagree with its config.json
            raise ModelFormatError(f"{what} gives {(self.offset - start) // np.dtype(np_dtype).itemsize} values where "
                                   f"the graph its config describes needs {list(shape)} "
                                   f"({expected // np.dtype(np_dtype).itemsize}): "
                                   f"the checkpoint does not match its config.json")
        return t

    def close(self) -> None:
        self.f.close()


def _large_constants(model) -> list:
    """Constant nodes the trace embedded (RoPE tables) beyond INLINE_CONSTANT_BYTES, renamed by their content so
    that a slice's graph finds the same bytes."""
    found = []
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            value = const_value(n)
            if value.nbytes > INLINE_CONSTANT_BYTES:
                found.append((n, f"const.{hashlib.sha256(value.tobytes()).hexdigest()[:16]}", value))
    return found


def _rename_input(model, old: str, new: str) -> None:
    for n in model.graph.node:
        for j, i in enumerate(n.input):
            if i == old:
                n.input[j] = new


def _cast(name: str):
    import onnx

    return onnx.helper.make_node("Cast", [f"{name}.float16"], [name], to=onnx.TensorProto.FLOAT, name=f"cast:{name}")


def stored_initializers(model, decoder, weights: Weights, lookup=None, writer: DataWriter | None = None,
                         weight_dtype: str = "float16") -> int:
    """Fold the traced graph and give it its initializers: written by `writer`, or (a slice) taken from `lookup`,
    the full export's TensorProtos by name. Returns how many were stored."""
    stored, consts = fold_plan(model, weights.names())
    casts, inits = [], []
    for st in stored:
        shape = shape_of(st, weights.shape(st.param), consts)
        dtype = stored_dtype(len(shape), weight_dtype)
        key = f"{st.name}.float16" if dtype == "float16" else st.name
        if lookup is not None:
            if key not in lookup:
                raise ModelFormatError(f"the export has no tensor {key}: it was not made by this exporter version")
            inits.append(lookup[key])
        else:
            inits.append(writer.tensor(key, shape, dtype, _chunks(st, weights, consts), f"weight {st.param}"))
        if dtype == "float16":
            casts.append(_cast(st.name))
    for node, name, value in _large_constants(model):
        _rename_input(model, node.output[0], name)
        model.graph.node.remove(node)
        if lookup is not None:
            inits.append(lookup[name])
        else:
            shape = tuple(value.shape)
            inits.append(writer.tensor(name, shape, "float32", iter([value.astype(np.float32)]), f"constant {name}"))
    model.graph.initializer.extend(inits)
    nodes = casts + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(inits)
