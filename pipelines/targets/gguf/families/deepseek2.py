"""DeepSeek-V3 / R1, Kimi-K2 and DeepSeek-V2 (DeepseekV3ForCausalLM, DeepseekV2ForCausalLM): llama.cpp arch `deepseek2`.

Multi-head latent attention (MLA): queries through a low-rank pair (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`,
or one `q_proj` where q_lora_rank is null, DeepSeek-V2-Lite), keys and values from one shared latent
(`kv_a_proj_with_mqa` -> its first kv_lora_rank rows, normed by `kv_a_layernorm`; its last qk_rope_head_dim rows
are the one rotary key every head shares). `kv_b_proj` expands the latent into each head's non-rotary key and
its value; llama.cpp runs the absorbed form (MQA over the latent), so as its converter does the expansion is split
per head into `attn_k_b` [heads, kv_lora_rank, qk_nope_head_dim] (the key part, transposed) and `attn_v_b`
[heads, v_head_dim, kv_lora_rank]. Keys are written as one KV head of kv_lora_rank + rope dims (values
kv_lora_rank), with the per-head sizes (`key_length_mla` / `value_length_mla`) beside them.

The rotary dimensions rotate in interleaved pairs (DeepSeek's layout; transformers' `rope_interleave`, on by
default), which is llama.cpp's NORM rope: nothing is permuted. YaRN scales the softmax by mscale_all_dim's
factor squared; llama.cpp reads it from `rope.scaling.yarn_log_multiplier` (0.1 x mscale_all_dim, its
converter's spelling) and computes the same only when mscale == mscale_all_dim (every released config). It
runs YaRN with beta_fast 32 / beta_slow 1 whatever the file says: Kimi-K2's 1 / 1 is refused
(`shared.refuse_yarn_betas`; measured at Kimi's rope geometry: f16 KL 2.3e-3 against 5e-7).

Layers: the first `first_k_dense_replace` dense (SwiGLU), the rest routed experts plus shared experts
(`shared.deepseek_moe`). DeepSeek-V3 and Kimi-K2 route by sigmoid scores plus `e_score_correction_bias`
(`exp_probs_b`), optionally within the best `topk_group` of `n_group` expert groups, renormalize
(`norm_topk_prob`) and scale by `routed_scaling_factor`; DeepSeek-V2 routes by softmax without either. The gating
function is written for both (llama.cpp's converter only writes the config's `scoring_func`, which transformers'
configs lack, and llama.cpp then takes softmax). A null q_lora_rank is written as 0: llama.cpp reads the key for
every layer count but 26 / 27 (V2-Lite), and a zero rank makes it use `attn_q` as it does there.

Released checkpoints append a multi-token-prediction layer after the trunk (`model.layers.{num_hidden_layers}`:
a whole decoder layer plus eh_proj, enorm, hnorm, shared_head): llama.cpp's converter drops it for this
architecture, and so does this family (`unused`). DeepSeek-V3 / R1 and Kimi-K2 are released as FP8 with block
scales (`weight_scale_inv`, a `quantization_config` of quant_method fp8): the converter refuses any pre-quantized
checkpoint in one line, as dequantizing FP8 blocks while streaming is not implemented (a bf16 copy converts,
and llama.cpp's converter dequantizes them to the same floats). Kimi-K2's config says
`DeepseekV3ForCausalLM` with model_type `kimi_k2` and remote code: the same keys, converted alike (but for its
YaRN betas, above).
"""

from __future__ import annotations

import re

import gguf
import numpy as np

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, EXPERT_GROUPS, LAYER, NORMS, ROTARY_BUFFERS, deepseek_moe, leading_dense, refuse_yarn_betas
from .spec import (
    A,
    Family,
    HParams,
    K,
    R,
    Rule,
    T,
    Transform,
    derived,
    name,
    param,
    refuse_rope,
    refuse_true,
    require_activation,
    tensor,
)

V3 = "DeepseekV3ForCausalLM"
ATTN = LAYER + ".self_attn"
GATING = {V3: gguf.ExpertGatingFuncType.SIGMOID, "DeepseekV2ForCausalLM": gguf.ExpertGatingFuncType.SOFTMAX}
# transformers' config-class defaults of the routing keys, which it computes with when a config.json omits them
DEFAULTS = {V3: dict(first_k_dense_replace=3, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4),
            "DeepseekV2ForCausalLM": dict(first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.0)}


def architecture(hp: HParams) -> str:
    return (hp.get("architectures") or [V3])[0]


def with_defaults(hp: HParams) -> HParams:
    """The config with its architecture's defaults for the routing keys it omits (or leaves null)."""
    return HParams({**DEFAULTS.get(architecture(hp), {}), **{k: v for k, v in hp.cfg.items() if v is not None}})


def dense_layers(hp: HParams) -> int:
    return leading_dense(with_defaults(hp), 0)


def _dims(hp: HParams) -> tuple[int, int, int, int]:
    """(qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank)."""
    return tuple(int(hp.require(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))


def split_kv_b(w: np.ndarray, hp: HParams) -> list[np.ndarray]:
    """kv_b_proj [heads x (nope + v), kv_lora] -> attn_k_b [heads, kv_lora, nope] (each head's key part,
    transposed: llama.cpp multiplies the queries' non-rotary part into the latent with it) and attn_v_b
    [heads, v, kv_lora]."""
    nope, _rope, v, _rank = _dims(hp)
    per_head = w.reshape(hp.n_head, nope + v, w.shape[-1])
    return [np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(per_head[:, nope:])]


def _split_shapes(shapes, hp: HParams):
    nope, _rope, v, _rank = _dims(hp)
    rows, rank = shapes[0]
    if rows != hp.n_head * (nope + v):
        raise ModelFormatError(f"kv_b_proj has {rows} rows, not {hp.n_head} heads x (qk_nope_head_dim {nope} + "
                               f"v_head_dim {v})")
    return [(hp.n_head, rank, nope), (hp.n_head, v, rank)]


SPLIT_KV_B = Transform("split_kv_b", lambda xs, hp: split_kv_b(xs[0], hp), _split_shapes)


def q_lora(hp: HParams, bid: int = 0) -> bool:
    return hp.get("q_lora_rank") is not None


def plain_q(hp: HParams, bid: int = 0) -> bool:
    return not q_lora(hp)


def is_mtp(hp: HParams, hf: str) -> bool:
    """A tensor of the multi-token-prediction layers after the trunk, which llama.cpp's converter drops."""
    m = re.match(r"model\.layers\.(\d+)\.", hf)
    return m is not None and int(m.group(1)) >= hp.n_layers


MLA = (
    tensor(T.ATTN_Q_A, ATTN + ".q_a_proj.weight", when=q_lora),
    tensor(T.ATTN_Q_A_NORM, ATTN + ".q_a_layernorm.weight", when=q_lora),
    tensor(T.ATTN_Q_B, ATTN + ".q_b_proj.weight", when=q_lora),
    tensor(T.ATTN_Q, ATTN + ".q_proj.weight", when=plain_q),
    tensor(T.ATTN_KV_A_MQA, ATTN + ".kv_a_proj_with_mqa.weight"),
    tensor(T.ATTN_KV_A_NORM, ATTN + ".kv_a_layernorm.weight"),
    Rule((name(T.ATTN_K_B), name(T.ATTN_V_B)), (ATTN + ".kv_b_proj.weight",), SPLIT_KV_B),
    tensor(T.ATTN_OUT, ATTN + ".o_proj.weight"),
)


def yarn_log_multiplier(hp: HParams) -> float | None:
    """0.1 x mscale_all_dim, as llama.cpp's converter writes it (its loader divides the 0.1 back out)."""
    mscale_all_dim = hp.rope.get("mscale_all_dim")
    return None if mscale_all_dim is None else 0.1 * float(mscale_all_dim)


def _check_yarn(hp: HParams) -> None:
    rope = hp.rope
    if rope["rope_type"] != "yarn" or float(rope.get("factor") or 1.0) <= 1.0:
        return
    if rope.get("attention_factor") is not None or rope.get("attn_factor") is not None:
        raise ModelFormatError("deepseek2 GGUF with a YaRN attention_factor is not supported: llama.cpp derives it "
                               "from mscale_all_dim")
    if rope.get("truncate") is False:
        raise ModelFormatError("deepseek2 GGUF with YaRN truncate=false is not supported: llama.cpp truncates the "
                               "correction range")
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not all_dim or mscale is None or float(mscale) != float(all_dim):
        raise ModelFormatError(f"deepseek2 GGUF with YaRN mscale={mscale} and mscale_all_dim={all_dim} is not "
                               "supported: llama.cpp computes transformers' attention scale only when they are equal")


def _check(hp: HParams) -> None:
    arch = architecture(hp)
    _dims(hp)
    refuse_rope(hp, "deepseek2", ("default", "yarn"))
    _check_yarn(hp)
    refuse_yarn_betas(hp, "deepseek2")
    refuse_true(hp, "deepseek2", "attention_bias", "llama.cpp's deepseek2 has no attention biases")
    refuse_true(hp, "deepseek2", "mlp_bias", "llama.cpp's deepseek2 has no MLP biases")
    require_activation(hp, "deepseek2", "silu", "llama.cpp's deepseek2 runs SwiGLU MLPs")
    if hp.get("rope_interleave") is False:
        raise ModelFormatError("deepseek2 with rope_interleave=false is not supported: llama.cpp rotates interleaved "
                               "pairs, as DeepSeek's weights are laid out")
    if hp.n_head_kv != hp.n_head:
        raise ModelFormatError(f"deepseek2 GGUF needs num_key_value_heads == num_attention_heads ({hp.n_head}): MLA "
                               f"expands a key and a value for every head, config has {hp.n_head_kv}")
    if not hp.get("n_shared_experts"):
        raise ModelFormatError("deepseek2 GGUF needs n_shared_experts >= 1: llama.cpp's deepseek2 always runs the "
                               "shared experts")
    if hp.get("scoring_func") not in (None, "sigmoid" if arch == V3 else "softmax"):
        raise ModelFormatError(f"{arch} with scoring_func {hp.get('scoring_func')!r} is not supported: transformers' "
                               f"{arch} routes by {GATING[arch].name.lower()}")
    if arch != V3:
        # transformers' DeepSeek-V2 router ranks groups by their best expert, llama.cpp by its two best; it never
        # renormalizes the top-k weights
        grouped = hp.get("topk_method") == "group_limited_greedy" and \
            (hp.get("n_group") or 1) > (hp.get("topk_group") or hp.get("n_group") or 1)
        if grouped:
            raise ModelFormatError("DeepseekV2 with topk_method group_limited_greedy is not supported: llama.cpp ranks "
                                   "expert groups by the sum of their two best scores, DeepSeek-V2 by the best one")
        refuse_true(hp, "deepseek2", "norm_topk_prob", "transformers' DeepseekV2 never renormalizes the top-k weights")


def _groups(hp: HParams, which: int):
    # DeepSeek-V2's groups only matter with group_limited_greedy, refused when they restrict (_check)
    return EXPERT_GROUPS[which].value(with_defaults(hp)) if architecture(hp) == V3 else None


FAMILY = Family(
    name="deepseek2",
    gguf_arch="deepseek2",
    architectures=(V3, "DeepseekV2ForCausalLM"),
    tensors=EMBEDDINGS + NORMS + MLA + deepseek_moe(dense_layers, bias_optional=True),  # V2 has no correction bias
    params=(
        param(K.VOCAB_SIZE, "vocab_size", required=True),
        derived(A.LAYERNORM_RMS_EPS, lambda hp: hp.get("rms_norm_eps", 1e-6), kind=float),
        derived(A.HEAD_COUNT_KV, lambda hp: 1),  # the absorbed form: one latent "KV head" (MQA)
        derived(K.LEADING_DENSE_BLOCK_COUNT, dense_layers),
        derived(A.Q_LORA_RANK, lambda hp: hp.get("q_lora_rank") or 0),
        derived(A.KV_LORA_RANK, lambda hp: _dims(hp)[3]),
        derived(A.KEY_LENGTH, lambda hp: _dims(hp)[3] + _dims(hp)[1]),
        derived(A.VALUE_LENGTH, lambda hp: _dims(hp)[3]),
        derived(A.KEY_LENGTH_MLA, lambda hp: _dims(hp)[0] + _dims(hp)[1]),
        derived(A.VALUE_LENGTH_MLA, lambda hp: _dims(hp)[2]),
        param(K.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size", "intermediate_size", required=True),
        derived(K.EXPERT_SHARED_COUNT, lambda hp: hp.get("n_shared_experts") or 0),
        derived(K.EXPERT_WEIGHTS_SCALE, lambda hp: with_defaults(hp).get("routed_scaling_factor"), kind=float),
        derived(K.EXPERT_WEIGHTS_NORM, lambda hp: True if with_defaults(hp).get("norm_topk_prob") else None, kind=bool),
        derived(K.EXPERT_GATING_FUNC, lambda hp: int(GATING[architecture(hp)])),
        derived(K.EXPERT_GROUP_COUNT, lambda hp: _groups(hp, 0)),
        derived(K.EXPERT_GROUP_USED_COUNT, lambda hp: _groups(hp, 1)),
        derived(R.DIMENSION_COUNT, lambda hp: _dims(hp)[1]),
        derived(R.SCALING_YARN_LOG_MUL, yarn_log_multiplier, kind=float),
    ),
    ignored=ROTARY_BUFFERS,
    unused=is_mtp,
    query_head_dim=lambda hp: _dims(hp)[0] + _dims(hp)[1],
    check=_check,
)
