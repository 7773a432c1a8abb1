"""LFM2 (Lfm2ForCausalLM): llama.cpp arch `lfm2`; LFM2-MoE (Lfm2MoeForCausalLM): llama.cpp arch `lfm2moe`.

A hybrid of two block kinds, chosen per layer by `layer_types` (or, in the first releases' configs, by
`full_attn_idxs`: the attention layers, every other one a convolution):

- short-convolution blocks: `conv.in_proj` makes B, C and x ([3 x hidden, hidden]), the depthwise causal
  convolution `conv.conv` ([hidden, 1, L]) runs over B * x, and `conv.out_proj` maps C * conv back. llama.cpp
  wants the kernel as a matrix [hidden, L] (the middle axis dropped) and keeps it f32 in every file type, as
  its quantizer does; it has no biases there (`conv_bias` is refused).
- attention blocks: Qwen 3's attention (per-head RMS norms `q_layernorm` / `k_layernorm` before a NEOX rope,
  nothing permuted) with the output projection named `self_attn.out_proj`.

llama.cpp tells the two apart by the per-layer `attention.head_count_kv`: 0 on a convolution layer, which then
holds `blk.N.shortconv.*` and a convolution state instead of a KV cache. Every layer has `operator_norm` (the
pre-norm of either block, llama.cpp's attn_norm), `ffn_norm` and a SwiGLU `feed_forward.w1/w3/w2` (gate, up,
down). The final norm is named `embedding_norm` but runs after the last block (llama.cpp's token_embd_norm).

The MLP's width is not `intermediate_size` (`block_ff_dim` in the released configs) as written: with
`block_auto_adjust_ff_dim` transformers takes two thirds of it, times `block_ffn_dim_multiplier`, rounded up to
`block_multiple_of` (only when a multiplier is set; llama.cpp's converter rounds in any case). The width written
is transformers' one, the width of the weights (8192 for LFM2-1.2B's 12288).

The released configs spell tied embeddings `tie_embedding` and carry no lm_head: as llama.cpp's converter, the
checkpoint decides (an `lm_head.weight` is the output matrix, none means the embedding is reused). Their rope
base defaults to transformers' 1e6 when the config has none.

Recurrent state per sequence (llama.cpp keeps it in f32 beside the attention layers' KV cache):
(L - 1) x hidden values per convolution layer (`recurrent_state`); LFM2-1.2B: 10 x 2 x 2048 = 160 KiB.

LFM2-MoE (LFM2-8B-A1B) is the same hybrid with MoE feed-forward blocks after `num_dense_layers` dense ones (those
`intermediate_size` wide as configured, no auto-adjust): a sigmoid router `feed_forward.gate`, a routing bias
`expert_bias` added to the scores for the choice only (llama.cpp's exp_probs_b) and per-expert w1 / w3 / w2
stacked. llama.cpp always renormalizes the chosen weights and never scales them: `norm_topk_prob: false`,
`use_expert_bias: false` and a `routed_scaling_factor` other than 1 are refused.
"""

from __future__ import annotations

import dataclasses

import gguf

from ....core.errors import ModelFormatError
from .shared import CONV_KERNEL, ROTARY_BUFFERS, VOCAB_AND_ROPE_DIMS
from .spec import (
    A,
    Family,
    HParams,
    K,
    R,
    Rule,
    T,
    derived,
    experts,
    param,
    refuse_rope,
    refuse_true,
    require_whole_heads,
    tensor,
)

LAYER = "model.layers.{bid}"
THETA = 1_000_000.0  # Lfm2Config.default_theta
KINDS = ("conv", "full_attention")

def layer_types(hp: HParams) -> list[str]:
    """Each layer's block: `layer_types`, else transformers' reading of `full_attn_idxs` (all attention if unset)."""
    types = hp.get("layer_types")
    if types is None:
        idxs = hp.get("full_attn_idxs")
        idxs = set(range(hp.n_layers)) if idxs is None else set(idxs)
        types = ["full_attention" if i in idxs else "conv" for i in range(hp.n_layers)]
    if len(types) != hp.n_layers or set(types) - set(KINDS):
        raise ModelFormatError(f"config.json layer_types must name conv or full_attention for each of the "
                               f"{hp.n_layers} layers, got {types!r}")
    return list(types)


def is_conv(hp: HParams, bid: int) -> bool:
    return layer_types(hp)[bid] == "conv"


def is_attention(hp: HParams, bid: int) -> bool:
    return not is_conv(hp, bid)


def ffn_width(hp: HParams) -> int:
    """The MLP width transformers builds (Lfm2MLP), which the weights have."""
    width = int(hp.require("block_ff_dim", "intermediate_size"))
    if hp.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = hp.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            of = int(hp.get("block_multiple_of", 256))
            width = of * ((int(multiplier * width) + of - 1) // of)
    return width


def kv_heads_per_layer(hp: HParams) -> list[int]:
    return [0 if t == "conv" else hp.n_head_kv for t in layer_types(hp)]


def l_cache(hp: HParams) -> int:
    return int(hp.find("conv_L_cache", default=3))


def recurrent_state(hp: HParams) -> int:
    """f32 values of recurrent state per sequence, all layers: llama.cpp's n_embd_r = (L - 1) x hidden per
    convolution layer (no SSM state)."""
    return sum(t == "conv" for t in layer_types(hp)) * (l_cache(hp) - 1) * hp.hidden


def _check(hp: HParams, arch: str = "lfm2") -> None:
    layer_types(hp)
    refuse_true(hp, arch, "conv_bias", "llama.cpp's short convolutions have no biases")
    if l_cache(hp) < 2:
        raise ModelFormatError(f"{arch} with conv_L_cache={l_cache(hp)} is not supported: llama.cpp's short "
                               "convolution needs a kernel of at least 2")
    refuse_rope(hp, arch, ("default",))
    require_whole_heads(hp, arch)


def _theta(hp: HParams) -> float:
    # rope_parameters (transformers 5) or rope_theta; transformers' LFM2 default when neither is set
    explicit = (hp.get("rope_parameters") or {}).get("rope_theta") if isinstance(hp.get("rope_parameters"), dict) else None
    return float(explicit or hp.get("rope_theta") or THETA)


# What both architectures share: everything but the feed-forward blocks.
BLOCKS = (
    tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
    tensor(T.TOKEN_EMBD_NORM, "model.embedding_norm.weight"),
    tensor(T.OUTPUT, "lm_head.weight", optional=True),  # released checkpoints are tied: none
    tensor(T.ATTN_NORM, LAYER + ".operator_norm.weight"),
    tensor(T.FFN_NORM, LAYER + ".ffn_norm.weight"),
    # the depthwise kernel [hidden, 1, L] as llama.cpp's [hidden, L] matrix (row r: channel r's kernel)
    tensor(T.SHORTCONV_CONV, LAYER + ".conv.conv.weight", CONV_KERNEL, when=is_conv),
    tensor(T.SHORTCONV_INPROJ, LAYER + ".conv.in_proj.weight", when=is_conv),
    tensor(T.SHORTCONV_OUTPROJ, LAYER + ".conv.out_proj.weight", when=is_conv),
    tensor(T.ATTN_Q, LAYER + ".self_attn.q_proj.weight", when=is_attention),
    tensor(T.ATTN_K, LAYER + ".self_attn.k_proj.weight", when=is_attention),
    tensor(T.ATTN_V, LAYER + ".self_attn.v_proj.weight", when=is_attention),
    tensor(T.ATTN_OUT, LAYER + ".self_attn.out_proj.weight", when=is_attention),
    tensor(T.ATTN_Q_NORM, LAYER + ".self_attn.q_layernorm.weight", when=is_attention),
    tensor(T.ATTN_K_NORM, LAYER + ".self_attn.k_layernorm.weight", when=is_attention),
)
PARAMS = VOCAB_AND_ROPE_DIMS + (
    derived(A.HEAD_COUNT_KV, kv_heads_per_layer, kind=list),
    derived(gguf.Keys.ShortConv.L_CACHE, l_cache),
    derived(R.FREQ_BASE, _theta, kind=float),
)


def dense_mlp(when=None) -> tuple[Rule, ...]:
    return (
        tensor(T.FFN_GATE, LAYER + ".feed_forward.w1.weight", when=when),
        tensor(T.FFN_UP, LAYER + ".feed_forward.w3.weight", when=when),
        tensor(T.FFN_DOWN, LAYER + ".feed_forward.w2.weight", when=when),
    )


LFM2 = Family(
    name="lfm2",
    gguf_arch="lfm2",
    architectures=("Lfm2ForCausalLM", "LFM2ForCausalLM"),
    tensors=BLOCKS + dense_mlp(),
    params=PARAMS + (derived(K.FEED_FORWARD_LENGTH, ffn_width),),
    rope=False,  # the base above (with transformers' default); scaled ropes are refused
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_output=None,  # the checkpoint decides (see above)
    tied_default=True,
    recurrent_state=recurrent_state,
    kv_layers=lambda hp: layer_types(hp).count("full_attention"),
)


# --- LFM2-MoE (Lfm2MoeForCausalLM, LFM2-8B-A1B): llama.cpp arch `lfm2moe` -----------------------------------------

def leading_dense(hp: HParams) -> int:
    return int(hp.get("num_dense_layers", 2))  # Lfm2MoeConfig's default


def _moe_check(hp: HParams) -> None:
    _check(hp, "lfm2moe")
    # llama.cpp's lfm2moe always renormalizes the top-k sigmoid weights, always adds the routing bias, never scales
    if hp.get("norm_topk_prob") is False:
        raise ModelFormatError("lfm2moe with norm_topk_prob=false is not supported: llama.cpp always renormalizes "
                               "the top-k expert weights")
    if hp.get("use_expert_bias") is False:
        raise ModelFormatError("lfm2moe with use_expert_bias=false is not supported: llama.cpp's lfm2moe needs the "
                               "routing bias")
    if hp.get("routed_scaling_factor") is not None and float(hp.get("routed_scaling_factor")) != 1.0:
        raise ModelFormatError(f"lfm2moe with routed_scaling_factor={hp.get('routed_scaling_factor')} is not "
                               "supported: llama.cpp's lfm2moe does not scale the expert weights")


def _dense(hp: HParams, bid: int) -> bool:
    return bid < leading_dense(hp)


def _moe(hp: HParams, bid: int) -> bool:
    return bid >= leading_dense(hp)


EXPERTS = LAYER + ".feed_forward.experts.{xid}"

LFM2MOE = dataclasses.replace(
    LFM2,
    name="lfm2_moe",
    gguf_arch="lfm2moe",
    architectures=("Lfm2MoeForCausalLM",),
    # The leading dense layers' MLP is intermediate_size wide as configured (no auto-adjust); then a sigmoid router
    # `feed_forward.gate`, its routing bias `expert_bias` (a buffer: llama.cpp's exp_probs_b, added to the scores
    # for the choice of experts only) and per-expert w1 / w3 / w2 stacked.
    tensors=BLOCKS + dense_mlp(_dense) + (
        tensor(T.FFN_GATE_INP, LAYER + ".feed_forward.gate.weight", when=_moe),
        tensor(T.FFN_EXP_PROBS_B, LAYER + ".feed_forward.expert_bias", suffix="bias", when=_moe),
        experts(T.FFN_GATE_EXP, EXPERTS + ".w1.weight", when=_moe),
        experts(T.FFN_UP_EXP, EXPERTS + ".w3.weight", when=_moe),
        experts(T.FFN_DOWN_EXP, EXPERTS + ".w2.weight", when=_moe),
    ),
    params=PARAMS + (
        param(K.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size", required=True),
        derived(K.LEADING_DENSE_BLOCK_COUNT, leading_dense),
        derived(K.EXPERT_GATING_FUNC, lambda hp: gguf.ExpertGatingFuncType.SIGMOID.value),
    ),
    check=_moe_check,
)

FAMILIES = (LFM2, LFM2MOE)
