"""Falcon-H1 (FalconH1ForCausalLM): llama.cpp arch `falcon-h1`.

Every layer runs attention and a Mamba-2 mixer side by side on the same normed input (`input_layernorm`) and
adds both to the residual, then a SwiGLU MLP behind `pre_ff_layernorm`. So every layer holds a KV cache *and*
a recurrent state.

The µP multipliers are folded into the weights, as llama.cpp's converter does (its graph has no key for
them); each one scales a linear map's input or output, so it is exact:
- `embedding_multiplier` -> token_embd, `lm_head_multiplier` -> output;
- `attention_in_multiplier` (the attention's input) -> q, k and v; `key_multiplier` (the keys, before the
  rope, which is linear) -> k too; `attention_out_multiplier` -> attn_output;
- `ssm_in_multiplier` (the mixer's input) -> ssm_in; `ssm_multipliers` (transformers' `mup_vector`: one
  factor for each of z, x, B, C and dt, the five row blocks of in_proj's output) -> ssm_in's rows;
  `ssm_out_multiplier` -> ssm_out;
- `mlp_multipliers` [gate, down] -> ffn_gate (scaled before the SiLU) and ffn_down.
Tied embeddings keep one matrix, scaled by `embedding_multiplier`: a tied config whose `lm_head_multiplier`
differs cannot be written that way and is refused (llama.cpp's converter would silently use the embedding's).

The mixer is Mamba-2 as llama.cpp runs it: `A_log` becomes A = -exp(A_log) ([heads, 1], `ssm_a`), `D` [heads, 1]
(`ssm_d`), `dt_bias` the bias of `ssm_dt`, the depthwise kernel [channels, 1, k] a [channels, k] matrix, and the
optional gated RMS norm (`mamba_rms_norm`) [groups, d_ssm / groups]. llama.cpp gates before that norm
(silu(z) * y, then the norm per group), which is transformers' `mamba_norm_before_gate: false`; it always adds
the convolution's bias and has no bias on the projections; transformers' dt clamp (`time_step_limit`) only
at its default (0, inf), where it does nothing. Other configs are refused in one line. The rope rotates
halves (NEOX), nothing is permuted. The pre-MLP norm is `blk.N.ffn_norm`, without `.weight`: the name llama.cpp's
converter writes and its falcon-h1 loads.

Recurrent state per sequence, per layer, in f32 (llama.cpp's n_embd_r + n_embd_s, `recurrent_state`):
(d_conv - 1) x (d_ssm + 2 x groups x d_state) convolution values + d_state x d_ssm SSM values. Falcon-H1-34B
(d_ssm 4096, 2 groups, d_state 256): 15,360 + 1,048,576 values = 4.06 MiB a layer, 292 MiB over its 72 layers.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from ....core.errors import ModelFormatError
from .shared import CONV_KERNEL, ROTARY_BUFFERS, SSM_A, SSM_D, Mamba2, check_mamba2, mamba2_params
from .spec import (
    A,
    Family,
    HParams,
    K,
    Rule,
    T,
    Transform,
    derived,
    elementwise,
    param,
    refuse_rope,
    refuse_true,
    require_activation,
    reshaped,
    tensor,
)

LAYER = "model.layers.{bid}"
MAMBA = LAYER + ".mamba"


def dims(hp: HParams) -> Mamba2:
    """The mixer's sizes, with transformers' defaults (d_ssm: mamba_expand x hidden when unset)."""
    return Mamba2(d_conv=int(hp.get("mamba_d_conv", 4)),
                  d_inner=int(hp.get("mamba_d_ssm") or int(hp.get("mamba_expand", 2) * hp.hidden)),
                  d_state=int(hp.get("mamba_d_state", 256)), n_heads=int(hp.get("mamba_n_heads", 128)),
                  n_groups=int(hp.get("mamba_n_groups", 1)))


def recurrent_state(hp: HParams) -> int:
    """f32 values of recurrent state per sequence, all layers (every layer has a mixer)."""
    return hp.n_layers * dims(hp).state_values


def _multiplier(key: str, default: float = 1.0):
    return lambda hp: default if hp.get(key) is None else hp.get(key)


def _pair(key: str, i: int):
    return lambda hp: (hp.get(key) or [1.0, 1.0])[i]


def scaled(label: str, *factors) -> Transform:
    """x times each factor in turn, each rounded to float32 first (the order llama.cpp's converter multiplies)."""
    def fn(x: np.ndarray, hp: HParams) -> np.ndarray:
        for factor in factors:
            x = x * np.float32(factor(hp))
        return x
    return elementwise(label, fn)


def _zxbcdt_blocks(hp: HParams) -> list[int]:
    """in_proj's output rows: z, x, B, C, dt (transformers' mup_vector blocks)."""
    m = dims(hp)
    return [m.d_inner, m.d_inner, m.n_groups * m.d_state, m.n_groups * m.d_state, m.n_heads]


def _scale_in_proj(w: np.ndarray, hp: HParams) -> np.ndarray:
    if w.shape[0] != sum(_zxbcdt_blocks(hp)):
        raise ModelFormatError(f"mamba.in_proj has {w.shape[0]} rows, the config implies z, x, B, C, dt of "
                               f"{_zxbcdt_blocks(hp)}")
    w = w * np.float32(_multiplier("ssm_in_multiplier")(hp))
    bounds = np.cumsum([0] + _zxbcdt_blocks(hp))
    for i, factor in enumerate(hp.get("ssm_multipliers") or [1.0] * 5):
        w[bounds[i]:bounds[i + 1]] *= np.float32(factor)
    return w


SSM_IN = reshaped("mup_in_proj", _scale_in_proj)  # rows scaled by block: whole tensor, not row slices
def _group_shape(shapes, hp):
    m = dims(hp)
    if shapes[0] != (m.d_inner,):
        raise ModelFormatError(f"mamba.norm is {list(shapes[0])}, the config implies [{m.d_inner}]")
    return [(m.n_groups, m.d_inner // m.n_groups)]


GROUP_NORM = Transform("grouped_norm", lambda xs, hp: [xs[0].reshape(dims(hp).n_groups, -1)], _group_shape)


def _gated_norm(hp: HParams, bid: int) -> bool:
    return bool(hp.get("mamba_rms_norm"))


def _unbounded_dt(limit) -> bool:
    """transformers' default time_step_limit (0, inf), as config.json may spell it ({"__float__": "Infinity"})."""
    if limit is None:
        return True
    lo, hi = (list(limit) + [None, None])[:2]
    hi = float(hi["__float__"]) if isinstance(hi, dict) and "__float__" in hi else hi
    return lo in (0, 0.0) and hi is not None and math.isinf(float(hi)) and float(hi) > 0


def _check(hp: HParams) -> None:
    require_activation(hp, "falcon-h1", "silu", "llama.cpp's falcon-h1 runs SiLU in the MLP and the mixer")
    for key, why in (("attention_bias", "llama.cpp's converter scales the biases by the input multiplier too"),
                     ("mlp_bias", "no released Falcon-H1 has MLP biases, none are mapped"),
                     ("projectors_bias", "llama.cpp's falcon-h1 mixer projections have no bias"),
                     ("mamba_proj_bias", "llama.cpp's falcon-h1 mixer projections have no bias")):
        refuse_true(hp, "falcon-h1", key, why)
    if hp.get("mamba_conv_bias") is False:
        raise ModelFormatError("falcon-h1 with mamba_conv_bias=false is not supported: llama.cpp's Mamba-2 always "
                               "adds the convolution's bias")
    if hp.get("mamba_rms_norm") and hp.get("mamba_norm_before_gate", True):
        raise ModelFormatError("falcon-h1 with mamba_rms_norm and mamba_norm_before_gate=true is not supported: "
                               "llama.cpp gates before the mixer's norm")
    if not _unbounded_dt(hp.get("time_step_limit")):
        raise ModelFormatError(f"falcon-h1 with time_step_limit={hp.get('time_step_limit')} is not supported: "
                               "llama.cpp does not clamp dt")
    tie_scales = (_multiplier("embedding_multiplier")(hp), _multiplier("lm_head_multiplier")(hp))
    if hp.get("tie_word_embeddings") and tie_scales[0] != tie_scales[1]:
        raise ModelFormatError(f"falcon-h1 with tied embeddings and embedding_multiplier {tie_scales[0]} != "
                               f"lm_head_multiplier {tie_scales[1]} is not supported: one shared matrix cannot "
                               "carry both")
    for key, n in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        if hp.get(key) is not None and (not isinstance(hp.get(key), list) or len(hp.get(key)) != n):
            raise ModelFormatError(f"falcon-h1 config {key} must be a list of {n} numbers, got {hp.get(key)!r}")
    check_mamba2("falcon-h1", dims(hp))
    refuse_rope(hp, "falcon-h1")


ATTN_IN = _multiplier("attention_in_multiplier")

FAMILY = Family(
    name="falcon_h1",
    gguf_arch="falcon-h1",
    architectures=("FalconH1ForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.embed_tokens.weight", scaled("embedding_scale", _multiplier("embedding_multiplier"))),
        tensor(T.OUTPUT_NORM, "model.final_layernorm.weight"),
        tensor(T.OUTPUT, "lm_head.weight", scaled("lm_head_scale", _multiplier("lm_head_multiplier")), optional=True),
        tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight"),
        # no `.weight` suffix: llama.cpp's falcon-h1 loads `blk.N.ffn_norm` as its converter names it
        Rule((gguf.TENSOR_NAMES[T.FFN_NORM],), (LAYER + ".pre_ff_layernorm.weight",)),
        tensor(T.ATTN_Q, LAYER + ".self_attn.q_proj.weight", scaled("q_scale", ATTN_IN)),
        tensor(T.ATTN_K, LAYER + ".self_attn.k_proj.weight",
               scaled("k_scale", _multiplier("key_multiplier"), ATTN_IN)),
        tensor(T.ATTN_V, LAYER + ".self_attn.v_proj.weight", scaled("v_scale", ATTN_IN)),
        tensor(T.ATTN_OUT, LAYER + ".self_attn.o_proj.weight",
               scaled("o_scale", _multiplier("attention_out_multiplier"))),
        tensor(T.SSM_IN, MAMBA + ".in_proj.weight", SSM_IN),
        tensor(T.SSM_CONV1D, MAMBA + ".conv1d.weight", CONV_KERNEL),
        tensor(T.SSM_CONV1D, MAMBA + ".conv1d.bias", suffix="bias"),
        tensor(T.SSM_DT, MAMBA + ".dt_bias", suffix="bias"),
        Rule((gguf.TENSOR_NAMES[T.SSM_A],), (MAMBA + ".A_log",), SSM_A),  # -exp(A_log); no .weight in llama.cpp
        Rule((gguf.TENSOR_NAMES[T.SSM_D],), (MAMBA + ".D",), SSM_D),
        tensor(T.SSM_NORM, MAMBA + ".norm.weight", GROUP_NORM, when=_gated_norm),
        tensor(T.SSM_OUT, MAMBA + ".out_proj.weight", scaled("ssm_out_scale", _multiplier("ssm_out_multiplier"))),
        tensor(T.FFN_GATE, LAYER + ".feed_forward.gate_proj.weight", scaled("gate_scale", _pair("mlp_multipliers", 0))),
        tensor(T.FFN_UP, LAYER + ".feed_forward.up_proj.weight"),
        tensor(T.FFN_DOWN, LAYER + ".feed_forward.down_proj.weight", scaled("down_scale", _pair("mlp_multipliers", 1))),
    ),
    params=(
        param(K.VOCAB_SIZE, "vocab_size", required=True),
    ) + mamba2_params(dims) + (
        derived(A.KEY_LENGTH, lambda hp: hp.head_dim),
        derived(A.VALUE_LENGTH, lambda hp: hp.head_dim),
    ),
    # a gated norm's weight a checkpoint may carry with mamba_rms_norm false: transformers does not load it either
    ignored=ROTARY_BUFFERS + (r"model\.layers\.\d+\.mamba\.norm\.weight",),
    check=_check,
    recurrent_state=recurrent_state,  # and a KV cache in every layer (kv_layers: all)
)
