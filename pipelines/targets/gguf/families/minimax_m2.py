"""MiniMax-M2 (MiniMaxM2ForCausalLM: MiniMax-M2, M2.1): llama.cpp arch `minimax-m2`.

Every layer is MoE (many experts, e.g. 256, 8 used), with no shared expert:

- Routing: a sigmoid of the router logits; the top-k experts are chosen on sigmoid + `e_score_correction_bias`
  and their sigmoid weights renormalized. llama.cpp's minimax-m2 reads the gating function from the file and
  has no default (it aborts without one): `expert_gating_func` is always written as sigmoid, which is what
  transformers computes whatever `scoring_func` says (a config naming another one is refused).
- The router `block_sparse_moe.gate` (kept f32), the bias `block_sparse_moe.e_score_correction_bias`
  (`exp_probs_b`) and per-expert `block_sparse_moe.experts.{xid}.w1/w2/w3` (gate, down, up), stacked.
  These are the released names and the ones transformers 5's `save_pretrained` writes (it renames
  `block_sparse_moe` to `mlp` and fuses the experts only in memory), so one layout serves both.
- q/k RMS norms over the whole projection, before it is split into heads (OLMo 2 style): `q_norm` is
  [heads x head_dim], `k_norm` [kv_heads x head_dim].
- Partial NEOX rope: only the first `rotary_dim` (64 of head_dim 128) dimensions of a head rotate, in halves;
  written as the rope dimension count, nothing permuted.
llama.cpp's minimax-m2 needs its own output matrix: tied embeddings are refused.
"""

from __future__ import annotations

import gguf

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, LAYER, NORMS, ROTARY_BUFFERS, attention
from .spec import (
    IDENTITY,
    Family,
    HParams,
    K,
    R,
    T,
    derived,
    experts,
    param,
    refuse_rope,
    refuse_true,
    require_activation,
    rotary_dims,
    tensor,
)

ARCH = "minimax-m2"
MOE = LAYER + ".block_sparse_moe"
SIGMOID = gguf.ExpertGatingFuncType.SIGMOID.value


def rope_dims(hp: HParams) -> int:
    """The released config's `rotary_dim`; transformers 5 keeps it and adds partial_rotary_factor = rotary_dim /
    head_dim to rope_parameters, which a config without rotary_dim gives instead."""
    return int(hp.get("rotary_dim") or rotary_dims(hp))


SPARSE_MOE = (
    tensor(T.FFN_GATE_INP, MOE + ".gate.weight"),
    tensor(T.FFN_EXP_PROBS_B, MOE + ".e_score_correction_bias", suffix="bias"),
    experts(T.FFN_GATE_EXP, MOE + ".experts.{xid}.w1.weight"),
    experts(T.FFN_DOWN_EXP, MOE + ".experts.{xid}.w2.weight"),
    experts(T.FFN_UP_EXP, MOE + ".experts.{xid}.w3.weight"),
)


def _check(hp: HParams) -> None:
    refuse_true(hp, ARCH, "tie_word_embeddings", "llama.cpp's minimax-m2 requires an untied output matrix")
    refuse_rope(hp, ARCH)
    require_activation(hp, ARCH, "silu", "llama.cpp's minimax-m2 runs SiLU-gated experts")
    score = hp.get("scoring_func")
    if score not in (None, "sigmoid"):
        raise ModelFormatError(f"{ARCH} with scoring_func {score!r} is not supported: transformers and llama.cpp's "
                               "minimax-m2 route with a sigmoid")
    dims = rope_dims(hp)
    if not 0 < dims <= hp.head_dim or dims % 2:
        raise ModelFormatError(f"{ARCH} rotary_dim {dims} must be an even number of dimensions within head_dim "
                               f"{hp.head_dim}")


FAMILY = Family(
    name="minimax_m2",
    gguf_arch=ARCH,
    architectures=("MiniMaxM2ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + (
        tensor(T.ATTN_Q_NORM, LAYER + ".self_attn.q_norm.weight"),
        tensor(T.ATTN_K_NORM, LAYER + ".self_attn.k_norm.weight"),
    ) + SPARSE_MOE,
    params=(
        derived(R.DIMENSION_COUNT, rope_dims),
        param(K.EXPERT_FEED_FORWARD_LENGTH, "intermediate_size"),  # each expert's width (there is no dense MLP)
        derived(K.EXPERT_GATING_FUNC, lambda hp: SIGMOID),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_output=None,  # never tied (refused): lm_head is always written
)
