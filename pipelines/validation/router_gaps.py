"""How close each position's MoE routing is to a tie, measured in the transformers reference.

An MoE layer sends each token to the experts with the k highest router scores. When the k-th and the (k+1)-th
score are nearly equal, any rounding (f16 weights, another summation order) may pick the other expert, and the
artifact then computes that position with another expert's weights: a large KL at that one position, while the
artifact is as faithful as any other elsewhere (measured on Qwen3-30B-A3B at f16: KL 1.5 at one position, 1e-5
at the rest; llama.cpp's own file does the same). The parity gates count such positions apart (`TIE_BOUND`).

The gap of a position in one layer is (k-th score - (k+1)-th score) / (highest - lowest score), the scores being
the router's logits (softmax routers: softmax keeps their order) or, for routers that select on
sigmoid(logits) + a correction bias (DeepSeek-V3, GLM-4.5), those. A position's gap is its smallest over the
MoE layers. Routers are found by shape, not by class: a module outside `experts` named like a gate or a router
whose 2-D weight is [experts, hidden].
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

# A position whose smallest routing gap is below this fraction of the router's score spread is a near-tie. The
# routers stay f32 in every GGUF type; what moves their scores is the rounding of the hidden state that reaches
# them, about 1e-4 of the spread at f16 (the measured f16 KL of 1e-6-1e-5 leaves little more). A wider bound
# would set apart a large share of a 128-expert model's positions, whose top-8 neighbours are close by nature.
TIE_BOUND = 0.001

_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k_experts")


def _config_int(config: Any, keys: tuple[str, ...]) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in keys:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def routers(model) -> list[tuple[str, Any]]:
    """(name, module) of every MoE router in `model`, found by its weight's shape [experts, hidden]."""
    experts = _config_int(model.config, _EXPERT_COUNT_KEYS)
    if experts is None:
        return []
    found = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        weight = getattr(module, "weight", None)
        if ("experts" in name.split(".") or not ("gate" in leaf or "router" in leaf) or weight is None
                or getattr(weight, "ndim", 0) != 2 or weight.shape[0] != experts):
            continue
        found.append((name, module))
    return found


def _gaps(module, x, top_k: int):
    import torch

    with torch.no_grad():
        rows = x.reshape(-1, module.weight.shape[1]).float()
        scores = rows @ module.weight.float().T
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.shape == scores.shape[-1:]:
            scores = scores + bias.float()
        correction = getattr(module, "e_score_correction_bias", None)
        if isinstance(correction, torch.Tensor) and correction.shape == scores.shape[-1:]:
            scores = torch.sigmoid(scores) + correction.float()
        ordered = scores.sort(dim=-1, descending=True).values
        spread = (ordered[:, 0] - ordered[:, -1]).clamp_min(1e-12)
        groups, kept = getattr(module, "num_group", None), getattr(module, "topk_group", None)
        if isinstance(correction, torch.Tensor) and isinstance(groups, int) and isinstance(kept, int) \
                and 1 < groups and kept < groups:
            # group-limited routing (DeepSeek-V3): the topk_group groups with the best sums of their two best
            # scores, then the top-k among their experts; a near-tie between groups flips experts as well
            by_group = scores.reshape(len(scores), groups, -1)
            group_scores = by_group.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
            group_gap = (group_scores[:, kept - 1] - group_scores[:, kept]) / spread
            cut = group_scores[:, kept - 1:kept, None]
            inside = by_group.topk(2, dim=-1).values.sum(-1, keepdim=True) >= cut
            masked = by_group.masked_fill(~inside, float("-inf")).reshape(len(scores), -1)
            ordered = masked.sort(dim=-1, descending=True).values
            expert_gap = ((ordered[:, top_k - 1] - ordered[:, top_k]) / spread).nan_to_num(posinf=float("inf"))
            return torch.minimum(group_gap, expert_gap).numpy()
        return ((ordered[:, top_k - 1] - ordered[:, top_k]) / spread).numpy()


class Recorder:
    """Each router's gaps, call by call, while the reference runs (`recording`)."""

    def __init__(self):
        self.calls: dict[str, list[np.ndarray]] = {}

    def per_sequence(self, lengths: list[int], padded_to: int | None) -> list[np.ndarray] | None:
        """The smallest gap over the routers at each position of each sequence; None for a dense model.
        `padded_to`: the sequences went through together, right-padded to this length (else one by one)."""
        if not self.calls:
            return None
        per_router = [np.concatenate(calls) for calls in self.calls.values()]
        smallest = np.minimum.reduce(per_router)
        if padded_to is not None:
            grid = smallest.reshape(len(lengths), padded_to)
            return [grid[i, :n].copy() for i, n in enumerate(lengths)]
        return [part.copy() for part in np.split(smallest, np.cumsum(lengths)[:-1])]


@contextmanager
def recording(model) -> Iterator[Recorder]:
    """Record the routing gaps of every forward pass inside the block (no effect on a dense model)."""
    recorder = Recorder()
    top_k = _config_int(model.config, _TOP_K_KEYS)
    handles = []
    for name, module in routers(model) if top_k else []:
        if top_k >= module.weight.shape[0]:
            continue  # every expert is used: nothing to tie

        def hook(mod, args, _name=name):
            recorder.calls.setdefault(_name, []).append(_gaps(mod, args[0], top_k))

        handles.append(module.register_forward_pre_hook(hook))
    try:
        yield recorder
    finally:
        for h in handles:
            h.remove()
