"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (q/k/v biases, NEOX rope: nothing permuted) with routed experts
plus one shared expert, llama.cpp arch `qwen2moe`.

Per-expert `mlp.experts.{xid}.gate_proj/up_proj/down_proj` (as checkpoints and transformers 5's
`save_pretrained` write them) are stacked into [experts, rows, cols]; the router `mlp.gate` becomes
`ffn_gate_inp`. The shared expert's sigmoid gate `mlp.shared_expert_gate` is a [1, hidden] linear that
llama.cpp reads as a {hidden} vector and keeps in f32, as its converter does: it is flattened to 1-D
(written f32 like every vector). llama.cpp's graph runs every layer as MoE and never renormalizes the
top-k weights, so configs with dense layers or `norm_topk_prob` are refused; its output matrix is required
(no tied fallback), so tied embeddings are refused too.
"""

from __future__ import annotations

import numpy as np

from ....errors import ModelFormatError
from .shared import EMBEDDINGS, LAYER, NORMS, ROTARY_BUFFERS, attention
from .spec import IDENTITY, K, Family, HParams, T, Transform, experts, param, refuse_rope, refuse_true, tensor

FLATTEN = Transform("flatten", lambda xs, hp: [np.ascontiguousarray(xs[0].reshape(-1))],
                    lambda s, hp: [(int(np.prod(s[0])),)])


def routed_experts(prefix: str = LAYER + ".mlp") -> tuple:
    """The router and the stacked gate/up/down projections of Qwen-style per-expert MLPs."""
    return (
        tensor(T.FFN_GATE_INP, prefix + ".gate.weight"),
        experts(T.FFN_GATE_EXP, prefix + ".experts.{xid}.gate_proj.weight"),
        experts(T.FFN_UP_EXP, prefix + ".experts.{xid}.up_proj.weight"),
        experts(T.FFN_DOWN_EXP, prefix + ".experts.{xid}.down_proj.weight"),
    )


SHARED_EXPERT = (
    tensor(T.FFN_GATE_INP_SHEXP, LAYER + ".mlp.shared_expert_gate.weight", FLATTEN),
    tensor(T.FFN_GATE_SHEXP, LAYER + ".mlp.shared_expert.gate_proj.weight"),
    tensor(T.FFN_UP_SHEXP, LAYER + ".mlp.shared_expert.up_proj.weight"),
    tensor(T.FFN_DOWN_SHEXP, LAYER + ".mlp.shared_expert.down_proj.weight"),
)


def dense_layers(hp: HParams) -> list[int]:
    """Layers transformers builds with a dense MLP instead of experts (`mlp_only_layers`, `decoder_sparse_step`)."""
    only = set(hp.get("mlp_only_layers") or ())
    step = int(hp.get("decoder_sparse_step") or 1)
    return [i for i in range(hp.n_layers) if i in only or (i + 1) % step != 0]


def check_moe(arch: str, hp: HParams, *, renormalizes: bool) -> None:
    """One-line refusals of the MoE configs llama.cpp's `arch` graph cannot run."""
    refuse_rope(hp, arch)
    dense = dense_layers(hp)
    if dense:
        raise ModelFormatError(f"{arch} GGUF: layers {dense} are dense (mlp_only_layers / decoder_sparse_step), "
                               f"but llama.cpp runs every {arch} layer as MoE")
    if bool(hp.get("norm_topk_prob", False)) != renormalizes:
        raise ModelFormatError(f"{arch} GGUF: llama.cpp {'always' if renormalizes else 'never'} renormalizes the "
                               f"top-k expert weights, config has norm_topk_prob={hp.get('norm_topk_prob')}")


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
