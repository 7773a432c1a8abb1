"""An MoE layer's stacked experts read one expert at a time while the streamed reference runs the layer.

transformers 5 holds a layer's experts as stacked parameters (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]). In fp32 one DeepSeek-V3 layer's stack is 45 GB and one Llama-4 Maverick MoE layer's
61 GB: a layer can no longer be the unit the reference holds. Their forward passes take one expert's matrix at a
time (`self.gate_up_proj[expert]`, for the experts some token is routed to), so the stack is replaced, while its
layer runs, by `ExpertSlices`: indexing it reads that expert's tensors from the checkpoint (its per-expert
tensors, or its rows of a fused one), widens them to fp32 and hands them over; nothing else of the stack is
resident. Forward passes that multiply all experts at once (Llama 4's batched matmul) run expert by expert
through `bmm_by_expert`, the same products. Stacks below `STREAM_MIN_BYTES` are loaded whole as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# Stacks smaller than this (fp32) are loaded whole: streaming them saves nothing worth a read per expert.
STREAM_MIN_BYTES = 1 << 30
STACKED = ("gate_up_proj", "down_proj")


def streams(attr: str, shape: tuple[int, ...]) -> bool:
    """Whether a parameter is a stack of experts large enough to read one expert at a time."""
    n = 4
    for d in shape:
        n *= d
    return attr in STACKED and len(shape) == 3 and n >= STREAM_MIN_BYTES


class ExpertSlices:
    """Stands for a stacked expert parameter [E, ...]: `[e]` reads expert e (`load_one(e)`, fp32)."""

    def __init__(self, shape: tuple[int, ...], load_one: Callable[[int], Any]):
        import torch

        self.shape = torch.Size(shape)
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.ndim = len(shape)
        self._load_one = load_one
        self.reads = 0

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        self.reads += 1
        value = self._load_one(int(index))
        rows, cols = self.shape[1:]
        if tuple(value.shape) == (cols, rows) != (rows, cols):  # stored inputs first (Qwen3-VL-MoE as released)
            value = value.T.contiguous()
        if tuple(value.shape) != tuple(self.shape[1:]):
            from ..core.errors import ModelFormatError

            raise ModelFormatError(f"an expert's tensor is {list(value.shape)}, the model's stack implies "
                                   f"{list(self.shape[1:])}")
        return value

    def to(self, *args, **kwargs):
        """Back to the meta device when the layer is dropped: an empty stand-in of the stack's shape."""
        import torch

        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def expert_loader(rule, source, read: Callable[[str], Any], n_experts: int) -> Callable[[int], Any] | None:
    """How to read expert e of the stack `rule` makes, or None when it cannot be read alone (then the stack is
    loaded whole). Per-expert sources (one tensor per expert, or gate then up per expert) are read by index;
    a fused checkpoint tensor [E, ...] by its rows of expert e."""
    import torch

    sources = rule.sources
    if rule.combine is None and len(sources) == 1 and source.info(sources[0]).shape[0] == n_experts \
            and source.info(sources[0]).dtype in ("F32", "F16", "BF16"):
        name = sources[0]

        def fused(e: int):
            out = torch.from_numpy(source.rows(name, e, e + 1)[0].copy())
            source.release(name)
            return out
        return fused
    if getattr(rule.combine, "mxfp4", False) and len(sources) == 2:  # gpt-oss's packed experts: expert e's rows
        blocks, scales = sources

        def packed(e: int):
            parts = [_packed_rows(source, name, e) for name in (blocks, scales)]
            return rule.combine([p.unsqueeze(0) for p in parts])[0]
        return packed
    if rule.combine is not None and len(sources) == n_experts and getattr(rule.combine, "stacks", False):
        return lambda e: read(sources[e])
    if rule.combine is not None and len(sources) == 2 * n_experts and getattr(rule.combine, "stacks_gate_up", False):
        return lambda e: torch.cat([read(sources[e]), read(sources[n_experts + e])], dim=0)
    return None


def _packed_rows(source, name: str, e: int):
    """Expert e's rows of a packed uint8 tensor [E, ...] (MXFP4 blocks or scales), copied out of the mapping."""
    import numpy as np
    import torch

    info = source.info(name)
    row = info.nbytes // info.shape[0]
    raw = source.where[name].raw(name)[e * row:(e + 1) * row]
    out = torch.from_numpy(np.array(raw).reshape(info.shape[1:]))
    source.release(name, e * row, (e + 1) * row)
    return out


def bmm_by_expert(module, hidden_states):
    """Llama 4's experts forward (tokens already grouped per expert, [E * T, H]), expert by expert: for each e,
    (x_e @ gate_up[e]) -> act(gate) * up -> @ down[e]; the same products as its batched matmuls."""
    import torch

    experts = module.gate_up_proj.shape[0]
    grouped = hidden_states.view(experts, -1, hidden_states.shape[-1])
    out = []
    for e in range(experts):
        gate, up = (grouped[e] @ module.gate_up_proj[e]).chunk(2, dim=-1)
        out.append((up * module.act_fn(gate)) @ module.down_proj[e])
    return torch.cat(out, dim=0).view(-1, out[0].shape[-1])


# An MoE layer's expert weights in a checkpoint: one tensor per expert (`experts.7.down_proj.weight`) or stacks.
_ONE_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_EXPERT_STACK = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_blocks)?$")  # _blocks: MXFP4, [E, R, n, 16]


class ExpertTally:
    """The expert weights of each layer, from the checkpoint's headers: what the plan needs to know how much of
    a layer the streamed reference holds at once."""

    def __init__(self):
        self.per_layer: dict[str, int] = {}
        self.per_expert: dict[tuple[str, str], int] = {}  # (layer, expert) -> that expert's weights
        self.stacked: list[int] = []  # one expert's share of each fused expert tensor

    def add(self, layer: str, name: str, shape: tuple[int, ...], n: int) -> None:
        one = _ONE_EXPERT.search(name)
        if not one and not (len(shape) in (3, 4) and _EXPERT_STACK.search(name)):
            return
        self.per_layer[layer] = self.per_layer.get(layer, 0) + n
        if not one:
            self.stacked.append(n // shape[0])
        key = (layer, one.group(1) if one else "stack")
        self.per_expert[key] = self.per_expert.get(key, 0) + (n if one else n // shape[0])

    def largest_stacked(self) -> int:
        """One expert's share of the largest fused expert tensor (what a converter slicing it holds at once)."""
        return max(self.stacked, default=0)

    def streamed_layer(self, layer_sizes: dict[str, int]) -> int:
        """The largest layer as the streamed reference holds it: its experts one at a time where their stacks are
        large enough to stream (gate_up is 2/3 of the experts' weights, down 1/3: both streamed past this)."""
        held = []
        for layer, total in layer_sizes.items():
            stacked = self.per_layer.get(layer, 0)
            if stacked * 4 // 3 >= STREAM_MIN_BYTES:
                one = max(n for (owner, _e), n in self.per_expert.items() if owner == layer)
                total = total - stacked + one
            held.append(total)
        return max(held, default=0)
