"""Qwen3-MoE: Qwen3 attention (q_norm/k_norm, NEOX rope, nothing permuted) with routed experts and no shared
expert, llama.cpp arch `qwen3moe`.

Per-expert `mlp.experts.{xid}.*_proj` are stacked as for Qwen2-MoE (`shared.routed_experts`); the expert
width is its own key (`moe_intermediate_size`). llama.cpp's graph runs every layer as MoE and always
renormalizes the top-k weights, so `mlp_only_layers` / `decoder_sparse_step` layouts with dense layers and `norm_topk_prob=false`
are refused in one line rather than converted into a model that computes something else.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, NORMS, QK_NORMS, ROTARY_BUFFERS, attention, check_moe, routed_experts
from .spec import IDENTITY, Family, HParams, K, param


def _check(hp: HParams) -> None:
    check_moe("qwen3moe", hp, renormalizes=True)


FAMILY = Family(
    name="qwen3_moe",
    gguf_arch="qwen3moe",
    architectures=("Qwen3MoeForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + QK_NORMS + routed_experts(),
    params=(param(K.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size"),),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
