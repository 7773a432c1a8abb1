"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (q/k/v biases, NEOX rope: nothing permuted) with routed experts
plus one shared expert, llama.cpp arch `qwen2moe`.

Per-expert `mlp.experts.{xid}.gate_proj/up_proj/down_proj` (as checkpoints and transformers 5's
`save_pretrained` write them) are stacked into [experts, rows, cols]; the router `mlp.gate` becomes
`ffn_gate_inp`. The shared expert's sigmoid gate `mlp.shared_expert_gate` is a [1, hidden] linear, written
as it is and in f32 as llama.cpp's converter writes it (llama.cpp reads it as a {hidden} vector: the trailing
1 is its second dimension). llama.cpp's graph runs every layer as MoE and never renormalizes the
top-k weights, so configs with dense layers or `norm_topk_prob` are refused; its output matrix is required
(no tied fallback), so tied embeddings are refused too.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, LAYER, NORMS, ROTARY_BUFFERS, attention, check_moe, routed_experts
from .spec import IDENTITY, Family, HParams, K, T, param, refuse_true, tensor

SHARED_EXPERT = (
    tensor(T.FFN_GATE_INP_SHEXP, LAYER + ".mlp.shared_expert_gate.weight"),
    tensor(T.FFN_GATE_SHEXP, LAYER + ".mlp.shared_expert.gate_proj.weight"),
    tensor(T.FFN_UP_SHEXP, LAYER + ".mlp.shared_expert.up_proj.weight"),
    tensor(T.FFN_DOWN_SHEXP, LAYER + ".mlp.shared_expert.down_proj.weight"),
)


def _check(hp: HParams) -> None:
    check_moe("qwen2moe", hp, renormalizes=False)
    refuse_true(hp, "qwen2moe", "tie_word_embeddings", "llama.cpp's qwen2moe requires an untied output matrix")


FAMILY = Family(
    name="qwen2_moe",
    gguf_arch="qwen2moe",
    architectures=("Qwen2MoeForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + routed_experts() + SHARED_EXPERT,
    params=(
        param(K.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size"),
        param(K.EXPERT_SHARED_FEED_FORWARD_LENGTH, "shared_expert_intermediate_size"),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
