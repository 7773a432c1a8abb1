"""Folds: what torch's constant folding does to a weight (the transpose of a linear weight, an expert's slice of
stacked MoE weights, Gemma's 1 + w), done on the stored values instead of in memory.

The export traces its graph with the parameters as graph inputs (export.py); `fold_plan` then rewrites the
graph so that every consumer reads a stored constant: each chain of foldable nodes hanging off a parameter
(their other inputs constants) is removed, and its result is a `Stored` value with a deterministic name (the
parameter's name and the folds applied), computed later from the parameter's values as they stream
(external_data.py). The same names in a graph of fewer layers point at the same stored bytes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

FOLDABLE = {"Transpose", "Gather", "Unsqueeze", "Squeeze", "Reshape", "Add", "Sub", "Mul", "Div", "Cast", "Identity"}


@dataclass
class Stored:
    """A value the graph reads as a constant: a parameter after `chain` (nodes applied in order)."""

    name: str  # deterministic: the parameter's name and the folds applied
    param: str  # the graph input (a parameter of the decoder)
    chain: list  # onnx NodeProtos, each foldable, first consuming the parameter
    shape: tuple[int, ...] = ()


def const_value(node) -> np.ndarray:
    from onnx import numpy_helper

    return numpy_helper.to_array(node.attribute[0].t)


def attrs(node) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def apply_node(node, x: np.ndarray, consts: dict[str, np.ndarray]) -> np.ndarray:
    """A foldable node on a value (its other inputs are constants)."""
    from onnx import helper

    a = attrs(node)
    other = [consts[i] for i in node.input[1:] if i in consts]
    op = node.op_type
    if op == "Transpose":
        return np.ascontiguousarray(np.transpose(x, a.get("perm")))
    if op == "Gather":
        return np.take(x, other[0], axis=a.get("axis", 0))
    if op == "Unsqueeze":
        return np.expand_dims(x, tuple(int(v) for v in other[0]))
    if op == "Squeeze":
        return np.squeeze(x, tuple(int(v) for v in other[0])) if other else np.squeeze(x)
    if op == "Reshape":
        return x.reshape(tuple(int(v) for v in other[0]))
    if op == "Cast":
        return x.astype(helper.tensor_dtype_to_np_dtype(a["to"]))
    if op == "Identity":
        return x
    y = other[0] if node.input[0] in consts else None  # constant on the left: c - x, c / x
    if y is not None:
        x, c = y, x
    else:
        c = other[0]
    return {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}[op](x, c)


def _fold_name(parent: str, node, consts: dict[str, np.ndarray]) -> str:
    if node.op_type == "Transpose" and list(attrs(node).get("perm", [])) == [1, 0]:
        return f"{parent}.T"
    h = hashlib.sha256(node.op_type.encode())
    for k, v in sorted(attrs(node).items()):
        h.update(f"{k}={v!r}".encode())
    for i in node.input:
        h.update(consts[i].tobytes() if i in consts else b"<value>")
    return f"{parent}.{node.op_type}{h.hexdigest()[:8]}"


def fold_plan(model, params: set[str]) -> tuple[list[Stored], dict[str, np.ndarray]]:
    """Rewrite the graph so that every consumer reads a stored constant: foldable chains from each parameter
    are removed and their results named deterministically. Returns (what to store, the small constants the
    folds read)."""
    graph = model.graph
    consts = {n.output[0]: const_value(n) for n in graph.node if n.op_type == "Constant" and n.attribute
              and n.attribute[0].name == "value"}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in graph.output}
    stored: list[Stored] = []
    removed: set[int] = set()
    renames: dict[str, str] = {}

    def foldable(node, value: str) -> bool:
        return node.op_type in FOLDABLE and all(i == value or i in consts for i in node.input) and \
            list(node.input).count(value) == 1

    def visit(value: str, name: str, param: str, chain: list) -> None:
        keep = value in graph_outputs
        for node in consumers.get(value, []):
            if foldable(node, value):
                removed.add(id(node))
                child = _fold_name(name, node, consts)
                renames[node.output[0]] = child
                visit(node.output[0], child, param, chain + [node])
            else:
                keep = True
        if keep:
            stored.append(Stored(name, param, chain))

    for p in sorted(params):
        if p in consumers or p in graph_outputs:
            visit(p, p, p, [])
    kept = [n for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(kept)
    for n in graph.node:
        for j, i in enumerate(n.input):
            if i in renames:
                n.input[j] = renames[i]
    # parameters are no longer graph inputs; constants only the folds read go
    inputs = [i for i in graph.input if i.name not in params]
    del graph.input[:]
    graph.input.extend(inputs)
    used = {i for n in graph.node for i in n.input} | graph_outputs
    kept = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] not in used)]
    del graph.node[:]
    graph.node.extend(kept)
    return stored, consts



def shape_after(node, shape: tuple[int, ...], consts: dict[str, np.ndarray]) -> tuple[int, ...]:
    """The shape a foldable node gives a value of `shape` (its other inputs are constants)."""
    a = attrs(node)
    other = [consts[i] for i in node.input[1:] if i in consts]
    op = node.op_type
    if op == "Transpose":
        perm = a.get("perm") or list(range(len(shape)))[::-1]
        return tuple(shape[i] for i in perm)
    if op == "Gather":
        axis = a.get("axis", 0) % len(shape)
        return shape[:axis] + tuple(np.shape(other[0])) + shape[axis + 1:]
    if op in ("Unsqueeze", "Squeeze", "Reshape"):
        probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, [0] * len(shape))
        return tuple(apply_node(node, probe, consts).shape)  # views of a one-element array: nothing allocated
    if op in ("Cast", "Identity"):
        return shape
    const = next(consts[i] for i in node.input if i in consts)
    return tuple(np.broadcast_shapes(shape, np.shape(const)))


def shape_of(st: Stored, shape: tuple[int, ...], consts: dict[str, np.ndarray]) -> tuple[int, ...]:
    """The stored value's shape: the parameter's `shape` through the chain."""
    for node in st.chain:
        shape = shape_after(node, shape, consts)
    return shape
