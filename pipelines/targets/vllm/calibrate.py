"""GPTQ over a streamed model: the calibration text runs through the transformers model one unit at a time, and
each unit's linear layers are quantized when the text reaches them, from the inputs the already-quantized
units before them produced (llm-compressor's sequential pipeline, on hive-aot's streamed model).

For each unit (a decoder layer, loaded by the streamed model as its forward starts), a forward pre-hook:
1. runs the unit's forward once on its real input with hooks on its quantized linears, which add each
   input's x^T x to a Hessian (padding positions left out; q/k/v, and gate/up, share one input and one
   Hessian);
2. quantizes each of those linears with GPTQ (gptq.py), smallest Hessian first, writes the stored form of
   its weight (pack.py) to a safetensors file of the unit, and puts the dequantized weight in its place;
3. lets the unit's real forward run on the quantized weights: its output is the next unit's input.

Only one unit is resident; the Hessians of one unit and GPTQ's factors of the largest one are the rest of
the peak (plan.py counts them). The pass stops after the last unit with a quantized layer (the head is never
loaded). Runs in a child process (pipelines.process.isolation): `calibrate_here`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.errors import ModelFormatError
from ...core.progress import bar
from .gptq import Grid, Hessian, gptq_quantize
from .pack import INT4_MAX, INT4_MIN, INT8_MAX, INT8_MIN, dequantize_groups, group_size_for, pack_int4

UNIT_FILE = "unit-{:05d}.safetensors"
SUMMARY = "calibration.json"


@dataclass(frozen=True)
class Scheme:
    """How a calibrated tier stores a weight: INT4 groups packed (W4A16) or INT8 per channel (W8A8)."""

    bits: int

    def grid(self, cols: int) -> Grid:
        if self.bits == 4:
            return Grid(INT4_MIN, INT4_MAX, group_size_for(cols))
        return Grid(INT8_MIN, INT8_MAX, None, bf16_scales=False)

    def stored(self, prefix: str, q, scales, shape: tuple[int, int]) -> dict[str, Any]:
        """The tensors the artifact holds for the weight `prefix`.weight (torch tensors)."""
        import torch

        if self.bits == 4:
            return {f"{prefix}.weight_packed": torch.from_numpy(pack_int4(q)),
                    f"{prefix}.weight_scale": scales.to(torch.bfloat16),
                    f"{prefix}.weight_shape": torch.tensor(shape, dtype=torch.int64)}
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scales.reshape(-1, 1).float()}


class _Stop(Exception):
    """Raised after the last unit that holds a quantized layer: nothing after it needs to run."""


def calibrate_here(model_dir: str, files: list[str], out_dir: str, weights: list[str], sequences: list[list[int]],
                   bits: int) -> dict[str, Any]:
    """Runs in a child (torch): GPTQ of the stored `weights` (names of nn.Linear weights in the checkpoint) over
    `sequences`, one safetensors file per unit in `out_dir`. Returns a summary (also written as SUMMARY)."""
    import torch

    from ...model.streamed_model import StreamedCausalLM, padded_batch
    from ...process.isolation import peak_memory

    scheme, out = Scheme(bits), Path(out_dir)
    wanted = set(weights)
    summary: dict[str, Any] = {"weights": {}, "units": 0, "tokens": sum(len(s) for s in sequences),
                               "sequences": len(sequences)}
    with StreamedCausalLM(Path(model_dir), [Path(f) for f in files]) as lm:
        linears = _quantized_linears(lm, wanted)
        missing = wanted - {stored for _m, stored in linears.values()}
        if missing:
            raise ModelFormatError(f"no linear layer of the transformers model is made from {sorted(missing)[:3]}")
        ids, mask = padded_batch(sequences)  # a pad is never attended to nor counted in a Hessian
        valid = mask.reshape(-1).bool()
        units = [(i, module, [(n, linears[id(m)]) for n, m in module.named_modules() if id(m) in linears])
                 for i, (_name, module, recurse) in enumerate(lm.units) if recurse or id(module) in linears]
        units = [u for u in units if u[2]]
        calibrated = bar(len(units), "calibrate", unit="unit")
        for index, module, members in units:
            module.register_forward_pre_hook(_unit_hook(index, members, valid, scheme, out, summary, calibrated),
                                             with_kwargs=True)
        if units:
            units[-1][1].register_forward_hook(_stop)
        try:
            with torch.inference_mode(), calibrated:
                lm.model(input_ids=ids, attention_mask=mask, use_cache=False)
        except _Stop:
            pass
    not_reached = wanted - set(summary["weights"])
    if not_reached:  # a layer the forward never ran (an unused branch): nothing to calibrate it with
        raise ModelFormatError(f"the calibration pass never reached {sorted(not_reached)[:3]}")
    summary["usage"] = peak_memory()
    (out / SUMMARY).write_text(json.dumps(summary))
    return {k: v for k, v in summary.items() if k != "weights"}


def _quantized_linears(lm, wanted: set[str]) -> dict[int, tuple[Any, str]]:
    """id(module) -> (the nn.Linear, its stored weight's name) for the linears made from `wanted` tensors."""
    import torch

    out = {}
    for path, module in lm.model.named_modules():
        rule = lm.rules.get(f"{path}.weight")
        if isinstance(module, torch.nn.Linear) and rule is not None and len(rule.sources) == 1 \
                and rule.sources[0] in wanted:
            out[id(module)] = (module, rule.sources[0])
    return out


def _stop(_module, _args, _output):
    raise _Stop


def _unit_hook(index: int, members: list[tuple[str, tuple[Any, str]]], valid, scheme: Scheme, out: Path,
               summary: dict[str, Any], calibrated):
    """The pre-hook of one unit (after the streamed model's own, which loads it): calibrate, quantize, write."""
    def hook(module, args, kwargs):
        hessians = _collect(module, args, kwargs, [lin for _n, (lin, _s) in members], valid)
        stored: dict[str, Any] = {}
        # smallest Hessian first: a Hessian is freed by its last user, so the largest is alone at its turn
        for _name, (linear, source) in sorted(members, key=lambda m: m[1][0].in_features):
            stored.update(_quantize(linear, source, hessians, scheme, summary))
        _save(stored, out / UNIT_FILE.format(index))
        summary["units"] += 1
        calibrated.update()
        return None
    return hook


def _collect(module, args, kwargs, linears: list, valid) -> dict[int, list]:
    """id(linear) -> [its Hessian, the number of linears sharing it] over one forward of the unit."""
    import torch

    by_input: list[tuple[Any, Hessian]] = []  # (an input tensor, kept alive so no other takes its id, its Hessian)
    shared: dict[int, list] = {}

    def add(linear, inputs):
        x = inputs[0]
        hessian = next((h for seen, h in by_input if seen is x), None)  # q/k/v (gate/up) get the same tensor
        if hessian is None:
            hessian = Hessian(x.shape[-1])
            by_input.append((x, hessian))
            rows = x.reshape(-1, x.shape[-1])
            hessian.add(rows[valid] if rows.shape[0] == valid.numel() else rows)
        shared[id(linear)] = [hessian]

    handles = [lin.register_forward_pre_hook(add) for lin in linears]
    try:
        with torch.inference_mode():
            module.forward(*args, **kwargs)  # not module(...): its own hooks (this one included) stay out
    finally:
        for h in handles:
            h.remove()
    by_input.clear()
    users: dict[int, int] = {}
    for entry in shared.values():
        users[id(entry[0])] = users.get(id(entry[0]), 0) + 1
    for entry in shared.values():
        entry.append(users[id(entry[0])])
    return shared


def _quantize(linear, source: str, hessians: dict[int, list], scheme: Scheme, summary: dict[str, Any]) -> dict[str, Any]:
    """GPTQ of one linear: its stored tensors; its weight replaced by the dequantized one."""
    import torch

    entry = hessians.pop(id(linear), None)
    if entry is None:
        raise ModelFormatError(f"{source}: its layer's forward never called it (no calibration input)")
    hessian, users = entry
    for other in hessians.values():
        if other[0] is hessian:
            other[1] -= 1
    w = linear.weight.data
    grid = scheme.grid(w.shape[1])
    # the last linear of a shared Hessian takes it (freed inside GPTQ); the others quantize with a copy
    q, scales = gptq_quantize(w, hessian, grid, spend=users == 1)
    deq = dequantize_groups(q, scales, grid.group or w.shape[1])
    err = float(torch.linalg.norm(deq - w) / torch.linalg.norm(w)) if float(torch.linalg.norm(w)) > 0 else 0.0
    summary["weights"][source] = {"group_size": grid.group, "weight_rel_error": err, "tokens": hessian.tokens}
    linear.weight.data.copy_(deq)
    return scheme.stored(source[: -len(".weight")], q, scales, tuple(w.shape))


def _save(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def read_summary(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / SUMMARY).read_text())


def unit_files(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("unit-*.safetensors"))

