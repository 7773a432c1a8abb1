"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM: ERNIE-4.5-21B-A3B, 300B-A47B): llama.cpp arch `ernie4_5-moe`.

The dense ERNIE 4.5 block (`ernie4_5.py`: Llama names, adjacent-pair rope, nothing permuted, tied embeddings
by default) with a MoE MLP from layer `moe_layer_start_index` on; the layers before it keep the dense SwiGLU
MLP of `intermediate_size` (written as `leading_dense_block_count`, the 21B has one, the 300B three).

- Routing: softmax over the router logits; the top-k experts are chosen on softmax + `e_score_correction_bias`
  (the bias chooses, it does not weigh) and their softmax weights renormalized. That is llama.cpp's softmax
  gating with `exp_probs_b` and normalized weights, which its graph hard-wires for this arch. The bias lives
  under `mlp.moe_statics.` as released (and as transformers 5 saves it), shaped [1, experts]: written as
  stored, kept f32 like every bias.
- Shared experts: `moe_num_shared_experts` of them run as one SwiGLU MLP of moe_intermediate_size x that
  count (`mlp.shared_experts.*`); the width is written as the shared expert length. (llama.cpp's converter
  writes intermediate_size / num_key_value_heads there, which equals it for both released models.)
- Per-expert `mlp.experts.{xid}.gate/up/down_proj` are stacked; the router `mlp.gate` stays f32.
- Multi-token-prediction tensors of the released checkpoints (`model.mtp_*`) are not part of the model.

llama.cpp loads expert tensors for every layer from the dense lead on and picks MoE by
(layer + 1) % moe_layer_interval: only an interval of 1 and MoE up to the last layer (`moe_layer_end_index`)
are runs of the same model, the others are refused; so are ERNIE's own refusals (biases, llama3 rope).
"""

from __future__ import annotations

import dataclasses

from ....core.errors import ModelFormatError
from .ernie4_5 import FAMILY as ERNIE
from .shared import LAYER, SWIGLU
from .spec import Family, HParams, K, T, derived, experts, tensor

ARCH = "ernie4_5-moe"
MOE = LAYER + ".mlp"
# Ernie4_5_MoeConfig's defaults, for the keys a config.json may leave out (the converter reads them through
# transformers, which fills them in)
DEFAULTS = {"moe_num_experts": 64, "moe_k": 6, "moe_num_shared_experts": 2, "moe_intermediate_size": 1536,
            "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1}


def setting(hp: HParams, key: str) -> int:
    value = hp.get(key)
    return int(DEFAULTS[key] if value is None else value)


def is_moe(hp: HParams, bid: int) -> bool:
    return bid >= setting(hp, "moe_layer_start_index")


def _dense(hp: HParams, bid: int) -> bool:
    return not is_moe(hp, bid)


def _shared(hp: HParams, bid: int) -> bool:
    return is_moe(hp, bid) and setting(hp, "moe_num_shared_experts") > 0


def _shared_width(hp: HParams) -> int | None:
    n = setting(hp, "moe_num_shared_experts")
    return setting(hp, "moe_intermediate_size") * n if n > 0 else None


MOE_MLP = (
    tensor(T.FFN_GATE_INP, MOE + ".gate.weight", when=is_moe),
    # absent from checkpoints trained without the correction (transformers' zeros then): the same routing
    tensor(T.FFN_EXP_PROBS_B, MOE + ".moe_statics.e_score_correction_bias", suffix="bias", optional=True, when=is_moe),
    experts(T.FFN_GATE_EXP, MOE + ".experts.{xid}.gate_proj.weight", when=is_moe),
    experts(T.FFN_UP_EXP, MOE + ".experts.{xid}.up_proj.weight", when=is_moe),
    experts(T.FFN_DOWN_EXP, MOE + ".experts.{xid}.down_proj.weight", when=is_moe),
    tensor(T.FFN_GATE_SHEXP, MOE + ".shared_experts.gate_proj.weight", when=_shared),
    tensor(T.FFN_UP_SHEXP, MOE + ".shared_experts.up_proj.weight", when=_shared),
    tensor(T.FFN_DOWN_SHEXP, MOE + ".shared_experts.down_proj.weight", when=_shared),
)

# the released checkpoints' multi-token-prediction block, norms and projection (llama.cpp skips them too)
MTP_TENSORS = (r"model\.mtp_(block|emb_norm|hidden_norm|linear_proj)\.\d+\..+",)


def _check(hp: HParams) -> None:
    ERNIE.check(hp)  # biases, rope scaling, activation
    interval = setting(hp, "moe_layer_interval")
    if interval != 1:
        raise ModelFormatError(f"{ARCH} with moe_layer_interval={interval} is not supported: llama.cpp loads experts "
                               "for every layer after the dense ones")
    end = setting(hp, "moe_layer_end_index")
    if end != -1 and end < hp.n_layers - 1:
        raise ModelFormatError(f"{ARCH} with moe_layer_end_index={end} is not supported: llama.cpp runs every layer "
                               f"after the dense ones as MoE, up to the last ({hp.n_layers - 1})")
    start = setting(hp, "moe_layer_start_index")
    if not 0 <= start < hp.n_layers:
        raise ModelFormatError(f"{ARCH} with moe_layer_start_index={start} is not supported: no MoE layer among the "
                               f"{hp.n_layers}")


FAMILY = Family(
    name="ernie4_5_moe",
    gguf_arch=ARCH,
    architectures=("Ernie4_5_MoeForCausalLM",),
    # the dense family's rules, its SwiGLU MLP only on the leading dense layers
    tensors=tuple(dataclasses.replace(r, when=_dense) if r in SWIGLU else r for r in ERNIE.tensors) + MOE_MLP,
    params=ERNIE.params + (
        derived(K.EXPERT_COUNT, lambda hp: setting(hp, "moe_num_experts")),
        derived(K.EXPERT_USED_COUNT, lambda hp: setting(hp, "moe_k")),
        derived(K.INTERLEAVE_MOE_LAYER_STEP, lambda hp: setting(hp, "moe_layer_interval")),
        derived(K.LEADING_DENSE_BLOCK_COUNT, lambda hp: setting(hp, "moe_layer_start_index")),
        derived(K.EXPERT_FEED_FORWARD_LENGTH, lambda hp: setting(hp, "moe_intermediate_size")),
        derived(K.EXPERT_SHARED_COUNT, lambda hp: setting(hp, "moe_num_shared_experts")),
        derived(K.EXPERT_SHARED_FEED_FORWARD_LENGTH, _shared_width),
    ),
    ignored=ERNIE.ignored + MTP_TENSORS,
    check=_check,
    tied_default=ERNIE.tied_default,
)
