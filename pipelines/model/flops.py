"""Floating-point operations a torch model's linear layers do while it runs: the work a reference or a check
pass is credited with (core/meter.py), so its rate can be set beside the host's GEMM rate.

Only `nn.Linear` is counted (2 operations per multiply-add of its matrix product): that is what a GEMM does
and most of a decoder's work. Attention's own products, norms and activations are left out, and so are
experts run by a model's own batched forward (not through `nn.Linear`): the count is a floor of the work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class LinearFlops:
    """Running total of the linear layers' FLOPs; `positions` counts the tokens that went through the model."""

    def __init__(self) -> None:
        self.flop = 0
        self.positions = 0

    def per_position(self) -> float:
        return self.flop / self.positions if self.positions else 0.0


@contextmanager
def counted(model) -> Iterator[LinearFlops]:
    """Count the FLOPs of `model`'s linear layers, and the tokens given to `model` itself, while the block runs."""
    import torch

    total = LinearFlops()

    def on_linear(module, args, _output) -> None:
        rows = args[0].numel() // module.in_features
        total.flop += 2 * rows * module.in_features * module.out_features

    def on_model(_module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            total.positions += int(ids.numel())

    hooks = [m.register_forward_hook(on_linear) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    hooks.append(model.register_forward_pre_hook(on_model, with_kwargs=True))
    try:
        yield total
    finally:
        for hook in hooks:
            hook.remove()
