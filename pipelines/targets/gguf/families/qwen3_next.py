"""Qwen3-Next (Qwen3NextForCausalLM): llama.cpp arch `qwen3next`.

A hybrid: most layers mix tokens with a gated delta-net (linear attention with a recurrent state), every
`full_attention_interval`-th layer (4 as released: `layer_types` when the config lists them) with gated full
attention; every layer's MLP is MoE with routed experts plus a shared expert behind a sigmoid gate.

- Every Qwen3-Next RMS norm computes x * (1 + w) and stores w (the input / post-attention norms, the final norm,
  the per-head q/k norms), so PLUS_ONE; the delta-net's gated output norm (`linear_attn.norm`, x * w * silu(z))
  is a plain weight and is not shifted.
- Full attention: `q_proj` yields each head's query and its output gate side by side ([heads, 2, head_dim]),
  which llama.cpp splits the same way, so it is written as it is (2 x heads x head_dim rows). The rope is NEOX
  over the first head_dim x partial_rotary_factor dimensions (0.25 unless the config says otherwise).
- Delta-net: `in_proj_qkvz` holds, per key head, that head's query, key, its group of values and of output
  gates; llama.cpp wants all queries, all keys, all values (`attn_qkv`, the order of the short convolution's
  channels) and the gates on their own (`attn_gate`): REGROUP_QKVZ. `in_proj_ba` is read as it is stored
  (per key head: betas, then alphas). The convolution [channels, 1, kernel] loses its middle axis and stays f32,
  `A_log` is written as the decay rate itself, A = -exp(A_log) (`ssm_a`), `dt_bias` as `ssm_dt.bias`.
- The shared expert's gate is a [1, hidden] linear, kept 2-D and f32 as llama.cpp's converter keeps it.
- The multi-token-prediction head of the released checkpoints (`mtp.*`, which transformers does not load) is
  not carried: llama.cpp's converter run with --no-mtp, the only way it converts a checkpoint saved by
  transformers (its default run requires the head). Whether a checkpoint has one is not in config.json, and the
  block count written before any tensor is read would depend on it.

llama.cpp's graph runs every layer as MoE, always renormalizes the top-k weights (transformers' default
norm_topk_prob=true), gives key and value heads one size (`ssm.state_size`), has no attention biases and
runs SiLU everywhere: other configs are refused in one line. The recurrent state per sequence and linear layer
is (kernel - 1) x (2 x key heads x key dim + value heads x value dim) convolution values plus value heads x
value dim^2 delta-rule values, f32 (`recurrent_state_values`); Qwen3-Next-80B-A3B: 3 x (2 x 16 x 128 + 32 x 128)
+ 32 x 128^2 = 548,864 values, 2.09 MiB per sequence in each of its 36 linear layers (75.4 MiB), beside a KV cache
in its 12 full-attention layers only.
"""

from __future__ import annotations

import gguf
import numpy as np

from ....core.errors import ModelFormatError
from .shared import CONV_KERNEL, LAYER, ROTARY_BUFFERS, check_moe, routed_experts
from .spec import (
    IDENTITY,
    PLUS_ONE,
    Family,
    HParams,
    K,
    R,
    Rule,
    T,
    Transform,
    derived,
    elementwise,
    param,
    refuse_true,
    require_activation,
    tensor,
)

ARCH = "qwen3next"
INTERVAL = 4  # Qwen3NextConfig's default full_attention_interval
PARTIAL_ROTARY = 0.25  # Qwen3NextConfig's default partial_rotary_factor
LINEAR, FULL = "linear_attention", "full_attention"
# The venv's gguf-py predates this key (llama.cpp's converter writes it from its own gguf-py).
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
S = gguf.Keys.SSM


def layer_types(hp: HParams) -> list[str]:
    """Each layer's token mixer: the config's `layer_types`, else every `full_attention_interval`-th layer full
    (transformers' rule for configs without the list, as released)."""
    types = hp.get("layer_types")
    if types is None:
        interval = int(hp.get("full_attention_interval") or INTERVAL)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(hp.n_layers)]
    if len(types) != hp.n_layers or set(types) - {LINEAR, FULL}:
        raise ModelFormatError(f"config.json layer_types must name {LINEAR} or {FULL} for each of the "
                               f"{hp.n_layers} layers, got {types!r}")
    return list(types)


def _linear(hp: HParams, bid: int) -> bool:
    return layer_types(hp)[bid] == LINEAR


def _full(hp: HParams, bid: int) -> bool:
    return not _linear(hp, bid)


def _heads(hp: HParams) -> tuple[int, int, int, int]:
    """(key heads, key head dim, value heads, value head dim) of the delta-net."""
    return (int(hp.require("linear_num_key_heads")), int(hp.require("linear_key_head_dim")),
            int(hp.require("linear_num_value_heads")), int(hp.require("linear_value_head_dim")))


def recurrent_state_values(hp: HParams) -> int:
    """Values of one sequence's recurrent state in one linear-attention layer (llama.cpp keeps them in f32): the
    short convolution's last kernel - 1 inputs of every channel, and each value head's dim x dim delta-rule
    state."""
    nk, dk, nv, dv = _heads(hp)
    conv = (int(hp.require("linear_conv_kernel_dim")) - 1) * (2 * nk * dk + nv * dv)
    return conv + nv * dv * dv


def partial_rotary(hp: HParams) -> float:
    """The rotated share of each head: top-level (transformers 4), in rope_parameters (5), else 0.25."""
    nested = hp.get("rope_parameters")
    nested = nested.get("partial_rotary_factor") if isinstance(nested, dict) else None
    return float(hp.find("partial_rotary_factor", default=nested if nested is not None else PARTIAL_ROTARY))


def regroup_qkvz(w: np.ndarray, hp: HParams) -> list[np.ndarray]:
    """[key heads x (q, k, v group, z group), hidden] -> [all q; all k; all v] and [all z] (llama.cpp's order)."""
    nk, dk, nv, dv = _heads(hp)
    group = nv // nk * dv
    g = w.reshape(nk, 2 * dk + 2 * group, w.shape[-1])
    q, k, v, z = np.split(g, np.cumsum([dk, dk, group])[:3], axis=1)
    flat = [np.ascontiguousarray(p.reshape(-1, w.shape[-1])) for p in (q, k, v, z)]
    return [np.concatenate(flat[:3]), flat[3]]


def _qkvz_shapes(shapes, hp: HParams):
    nk, dk, nv, dv = _heads(hp)
    rows, hidden = shapes[0]
    if rows != 2 * nk * dk + 2 * nv * dv:
        raise ModelFormatError(f"in_proj_qkvz has {rows} rows, the config implies {2 * nk * dk + 2 * nv * dv}")
    return [(2 * nk * dk + nv * dv, hidden), (nv * dv, hidden)]


# Looked up at call time, so a negative-control test can replace regroup_qkvz.
REGROUP_QKVZ = Transform("regroup_qkvz", lambda xs, hp: regroup_qkvz(xs[0], hp), _qkvz_shapes)


def decay_rate(a_log: np.ndarray) -> np.ndarray:
    """A = -exp(A_log), correctly rounded (exp in float64): numpy's float32 exp is an ulp off in a third of the
    values, torch's (llama.cpp's converter) in about 1%; this is the closest a converter without torch gets."""
    return (-np.exp(a_log.astype(np.float64))).astype(np.float32)


NEG_EXP = elementwise("neg_exp", lambda x, hp: decay_rate(x))  # decay_rate looked up at call time (negative control)

ATTN, DELTA, MLP = LAYER + ".self_attn", LAYER + ".linear_attn", LAYER + ".mlp"

TENSORS: tuple[Rule, ...] = (
    tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
    tensor(T.OUTPUT_NORM, "model.norm.weight", PLUS_ONE),
    tensor(T.OUTPUT, "lm_head.weight", optional=True),  # absent when tied: llama.cpp reuses token_embd
    tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight", PLUS_ONE),
    tensor(T.ATTN_POST_NORM, LAYER + ".post_attention_layernorm.weight", PLUS_ONE),
    # gated full attention
    tensor(T.ATTN_Q, ATTN + ".q_proj.weight", when=_full),
    tensor(T.ATTN_K, ATTN + ".k_proj.weight", when=_full),
    tensor(T.ATTN_V, ATTN + ".v_proj.weight", when=_full),
    tensor(T.ATTN_OUT, ATTN + ".o_proj.weight", when=_full),
    tensor(T.ATTN_Q_NORM, ATTN + ".q_norm.weight", PLUS_ONE, when=_full),
    tensor(T.ATTN_K_NORM, ATTN + ".k_norm.weight", PLUS_ONE, when=_full),
    # gated delta-net
    Rule((f"{gguf.TENSOR_NAMES[T.ATTN_QKV]}.weight", f"{gguf.TENSOR_NAMES[T.ATTN_GATE]}.weight"),
         (DELTA + ".in_proj_qkvz.weight",), REGROUP_QKVZ, when=_linear),
    tensor(T.SSM_BETA_ALPHA, DELTA + ".in_proj_ba.weight", when=_linear),
    tensor(T.SSM_CONV1D, DELTA + ".conv1d.weight", CONV_KERNEL, when=_linear),  # [channels, kernel], as Mamba's
    tensor(T.SSM_DT, DELTA + ".dt_bias", suffix="bias", when=_linear),
    Rule((gguf.TENSOR_NAMES[T.SSM_A],), (DELTA + ".A_log",), NEG_EXP, when=_linear),  # no .weight suffix
    tensor(T.SSM_NORM, DELTA + ".norm.weight", when=_linear),  # x * w * silu(z): the weight itself
    tensor(T.SSM_OUT, DELTA + ".out_proj.weight", when=_linear),
) + routed_experts() + (
    tensor(T.FFN_GATE_INP_SHEXP, MLP + ".shared_expert_gate.weight", IDENTITY),
    tensor(T.FFN_GATE_SHEXP, MLP + ".shared_expert.gate_proj.weight"),
    tensor(T.FFN_UP_SHEXP, MLP + ".shared_expert.up_proj.weight"),
    tensor(T.FFN_DOWN_SHEXP, MLP + ".shared_expert.down_proj.weight"),
)


def _check(hp: HParams) -> None:
    # transformers' default norm_topk_prob for this model is true (a config may omit it)
    check_moe(ARCH, HParams({**hp.cfg, "norm_topk_prob": hp.get("norm_topk_prob", True)}), renormalizes=True)
    require_activation(hp, ARCH, "silu", "llama.cpp's qwen3next runs SiLU in its convolution and MLPs")
    refuse_true(hp, ARCH, "attention_bias", "llama.cpp's qwen3next has no attention output bias")
    nk, dk, nv, dv = _heads(hp)
    if dk != dv:
        raise ModelFormatError(f"{ARCH} with linear_key_head_dim {dk} != linear_value_head_dim {dv} is not "
                               "supported: llama.cpp's qwen3next gives key and value heads one size")
    if nv % nk:
        raise ModelFormatError(f"{ARCH}: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
    layer_types(hp)


FAMILY = Family(
    name="qwen3_next",
    gguf_arch=ARCH,
    architectures=("Qwen3NextForCausalLM",),
    tensors=TENSORS,
    params=(
        param(K.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size"),
        param(K.EXPERT_SHARED_FEED_FORWARD_LENGTH, "shared_expert_intermediate_size"),
        param(S.CONV_KERNEL, "linear_conv_kernel_dim", required=True),
        param(S.STATE_SIZE, "linear_key_head_dim", required=True),
        param(S.GROUP_COUNT, "linear_num_key_heads", required=True),
        param(S.TIME_STEP_RANK, "linear_num_value_heads", required=True),
        derived(S.INNER_SIZE, lambda hp: _heads(hp)[2] * _heads(hp)[3]),
        derived(RECURRENT_LAYERS, lambda hp: [t == LINEAR for t in layer_types(hp)], kind=list),
        derived(K.FULL_ATTENTION_INTERVAL, lambda hp: hp.get("full_attention_interval") or INTERVAL),
        derived(R.DIMENSION_COUNT, lambda hp: int(hp.head_dim * partial_rotary(hp))),
    ),
    ignored=ROTARY_BUFFERS + (r"mtp\..+",),
    query_gate=True,
    check=_check,
    recurrent_state=lambda hp: layer_types(hp).count(LINEAR) * recurrent_state_values(hp),
    kv_layers=lambda hp: layer_types(hp).count(FULL),
)
