"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): llama.cpp arch `glm4moe`.

- Llama-style attention with q/k/v biases (`attention_bias`, true in the released configs; o_proj has none) and,
  on GLM-4.5 (355B) and 4.6, per-head RMS norms of queries and keys (`use_qk_norm`) before the rope.
- A partial rope: the first head_dim x partial_rotary_factor dimensions (transformers' default 0.5) rotate as
  halves (NEOX), llama.cpp's glm4moe rope: nothing permuted, `rope.dimension_count` set to that.
- Two norms per block: `input_layernorm` (attn_norm) and `post_attention_layernorm`, the norm before the MLP,
  which llama.cpp's glm4moe reads as `post_attention_norm` (it has no ffn_norm).
- The first `first_k_dense_replace` layers dense (SwiGLU), the others routed experts with shared experts, sigmoid
  scores plus `e_score_correction_bias` (`exp_probs_b`) for the choice, expert groups, renormalized top-k
  weights (`norm_topk_prob`, true by default) scaled by `routed_scaling_factor` (`shared.deepseek_moe`). The
  gating function is always sigmoid, written as llama.cpp's converter writes it.
- Multi-token prediction (NextN): released checkpoints append `num_nextn_predict_layers` layers after the trunk,
  at `model.layers.{num_hidden_layers}`: a whole MoE decoder layer plus `eh_proj` (the projection of [embedding;
  hidden]), `enorm`, `hnorm`, and optionally its own `embed_tokens` and `shared_head.{norm,head}`. llama.cpp's
  converter keeps them: the GGUF holds num_hidden_layers + num_nextn_predict_layers blocks and says how many are
  NextN (`nextn_predict_layers`); llama.cpp runs the trunk and leaves them for speculative decoding. A
  checkpoint without them (transformers' save_pretrained writes only the trunk) converts to a trunk-only file
  with the same keys, which llama.cpp loads as well.

Refused: M-RoPE sections (GLM-4.5V, the vision model: another architecture), no shared expert (llama.cpp's graph
always runs one), rope scalings llama.cpp cannot reproduce here and another activation than SiLU.
"""

from __future__ import annotations

import gguf

from ....core.errors import ModelFormatError
from .glm4 import rotary_dims  # GLM-4's partial rope (default 0.5 in both configs)
from .shared import (
    EMBEDDINGS,
    EXPERT_GROUPS,
    LAYER,
    QK_NORMS,
    ROTARY_BUFFERS,
    attention,
    deepseek_moe,
    leading_dense,
    refuse_yarn_betas,
)
from .spec import IDENTITY, Family, HParams, K, R, Rule, T, derived, param, refuse_rope, require_activation, tensor

DEFAULT_DENSE = 1  # Glm4MoeConfig's default first_k_dense_replace


def nextn_layers(hp: HParams) -> int:
    return int(hp.get("num_nextn_predict_layers") or 0)


def trunk(hp: HParams, bid: int) -> bool:
    return bid < hp.n_layers


def nextn(hp: HParams, bid: int) -> bool:
    return bid >= hp.n_layers


def qk_norm(hp: HParams, bid: int) -> bool:
    return bool(hp.get("use_qk_norm"))


def _both(first, second):
    if first is None:
        return second
    return lambda hp, bid: first(hp, bid) and second(hp, bid)


BLOCK = (
    tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight"),
    *attention(q=IDENTITY, k=IDENTITY),
    *(Rule(r.outputs, r.inputs, r.transform, r.optional, qk_norm) for r in QK_NORMS),
    tensor(T.ATTN_POST_NORM, LAYER + ".post_attention_layernorm.weight"),
    *deepseek_moe(lambda hp: leading_dense(hp, DEFAULT_DENSE), bias_optional=False),
)
NEXTN = (
    tensor(T.NEXTN_EH_PROJ, LAYER + ".eh_proj.weight"),
    tensor(T.NEXTN_ENORM, LAYER + ".enorm.weight"),
    tensor(T.NEXTN_HNORM, LAYER + ".hnorm.weight"),
    tensor(T.NEXTN_EMBED_TOKENS, LAYER + ".embed_tokens.weight", optional=True),
    tensor(T.NEXTN_SHARED_HEAD_HEAD, LAYER + ".shared_head.head.weight", optional=True),
    tensor(T.NEXTN_SHARED_HEAD_NORM, LAYER + ".shared_head.norm.weight", optional=True),
)
# The trunk's layers as they are; the NextN layers' the same block and their own tensors, all optional: a trunk-only
# checkpoint converts (absent NextN layers are skipped whole, a partly present one is still refused per tensor).
TENSORS = EMBEDDINGS + tuple(Rule(r.outputs, r.inputs, r.transform, r.optional, _both(r.when, trunk)) for r in BLOCK) \
    + tuple(Rule(r.outputs, r.inputs, r.transform, True, _both(r.when, nextn)) for r in BLOCK + NEXTN)


def _check(hp: HParams) -> None:
    if hp.rope.get("mrope_section") is not None:
        raise ModelFormatError("glm4moe GGUF with mrope_section (GLM-4.5V M-RoPE) is not supported: the text model's "
                               "rope is written without dimension sections")
    refuse_rope(hp, "glm4moe", ("default", "linear", "yarn"))
    rope = hp.rope
    if rope["rope_type"] == "yarn" and any(rope.get(k) is not None for k in ("mscale", "mscale_all_dim",
                                                                               "attention_factor")):
        raise ModelFormatError("glm4moe GGUF with a YaRN mscale / attention_factor is not supported: llama.cpp's "
                               "glm4moe scales attention by the factor alone")
    refuse_yarn_betas(hp, "glm4moe")
    require_activation(hp, "glm4moe", "silu", "llama.cpp's glm4moe runs SwiGLU MLPs")
    if rotary_dims(hp) % 2 or not 0 < rotary_dims(hp) <= hp.head_dim:
        raise ModelFormatError(f"glm4moe GGUF needs an even rotary dimension count in 2..head_dim, config gives "
                               f"{rotary_dims(hp)}")
    if not hp.get("n_shared_experts", 1):
        raise ModelFormatError("glm4moe GGUF needs n_shared_experts >= 1: llama.cpp's glm4moe always runs a shared "
                               "expert")


FAMILY = Family(
    name="glm4_moe",
    gguf_arch="glm4moe",
    architectures=("Glm4MoeForCausalLM",),
    tensors=TENSORS,
    params=(
        derived(K.BLOCK_COUNT, lambda hp: hp.n_layers + nextn_layers(hp)),
        param(K.VOCAB_SIZE, "vocab_size", required=True),
        derived(R.DIMENSION_COUNT, rotary_dims),
        param(K.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size", required=True),
        derived(K.EXPERT_SHARED_COUNT, lambda hp: hp.get("n_shared_experts", 1)),
        derived(K.LEADING_DENSE_BLOCK_COUNT, lambda hp: leading_dense(hp, DEFAULT_DENSE)),
        derived(K.EXPERT_GATING_FUNC, lambda hp: int(gguf.ExpertGatingFuncType.SIGMOID)),
        param(K.EXPERT_WEIGHTS_SCALE, "routed_scaling_factor", kind=float),
        # transformers renormalizes unless told not to; llama.cpp only when the key says so
        derived(K.EXPERT_WEIGHTS_NORM, lambda hp: bool(hp.get("norm_topk_prob", True)), kind=bool),
        *EXPERT_GROUPS,
        derived(K.NEXTN_PREDICT_LAYERS, lambda hp: hp.get("num_nextn_predict_layers")),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
    blocks=lambda hp: hp.n_layers + nextn_layers(hp),
)
