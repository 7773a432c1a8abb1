"""Per-token activation quantization inside a transformers 5 experts module, as vLLM's W8A8 MoE computes it.

vLLM's FP8 / INT8 W8A8 MoE kernels quantize each token's activations in front of both expert GEMMs: the
hidden state going into gate_up, and act(gate) * up going into down. A transformers experts module
(Qwen3MoeExperts, MixtralExperts, ...) holds the stacked weights and, in its eager implementation,
multiplies with `nn.functional.linear(x, weight[e])` per expert, so there is no submodule to hook; while
such a module runs, every `nn.functional.linear` call quantizes its input first. The first call's input is already
quantized by the module's pre-hook in effect: quantizing it again is exact (the same per-token scale
reproduces the same values).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_active = threading.local()  # the quantizer of the experts module running in this thread, if any
_original_linear = None


def is_experts(module) -> bool:
    """A transformers 5 experts module: the stacked projections of an MoE layer's experts."""
    return module is not None and type(module).__name__.endswith("Experts")


def _linear(x, weight, bias=None):
    quantize = getattr(_active, "quantize", None)
    return _original_linear(x if quantize is None else quantize(x), weight, bias)


def quantize_expert_inputs(module, quantize: Callable) -> None:
    """While `module` runs, the input of each of its expert GEMMs is `quantize`d per token."""
    import torch

    global _original_linear
    if _original_linear is None:  # patched once per process; inert outside an experts module's forward
        _original_linear = torch.nn.functional.linear
        torch.nn.functional.linear = _linear

    def enter(_module, _args):
        _active.quantize = quantize

    def leave(_module, _args, _output):
        _active.quantize = None

    # transformers' grouped_mm / batched_mm implementations multiply without nn.functional.linear: the eager
    # loop, expert by expert (what a streamed experts module runs anyway), is the one whose inputs are seen
    module.config._experts_implementation = "eager"
    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)  # also when the forward raises: never left switched on
