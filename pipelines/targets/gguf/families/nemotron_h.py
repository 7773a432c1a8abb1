"""Nemotron-H (NemotronHForCausalLM: NVIDIA-Nemotron-Nano-9B/12B-v2, Nemotron-H-8B/47B): llama.cpp arch `nemotron_h`.

A stack of single-mixer blocks under `backbone.*` (`backbone.embeddings`, `backbone.layers.N.norm` +
`.mixer.*`, `backbone.norm_f`, an untied `lm_head`): each block is one RMS norm, one mixer and the residual.
The mixer of each block is given by `hybrid_override_pattern` as released ("M" Mamba-2, "*" attention, "-" a
squared-ReLU MLP), or by `layers_block_type` as transformers 5 saves it (then without num_hidden_layers).

- Mamba-2 (`shared.mamba2_mixer`): in_proj, conv1d as [channels, kernel], dt_bias, A = -exp(A_log), D, the
  gated norm grouped as [n_groups, d_inner / n_groups]. d_inner is mamba_num_heads x mamba_head_dim (the
  9B-v2's 128 x 80 = 10240 is not 2 x hidden 4480: this arch, unlike granitehybrid, takes it as it is).
- Attention has no positional encoding at all (llama.cpp's rope type NONE); Q and K are still permuted as
  llama.cpp's converter does, which changes no dot product.
- llama.cpp tells the blocks apart by two per-layer lists: `attention.head_count_kv` (non-zero: attention)
  and `feed_forward_length` (non-zero: MLP); both zero is a Mamba block. Norms use `layer_norm_epsilon`.
- The MoE variant (pattern "E", Nemotron-3-Nano-30B-A3B: llama.cpp's `nemotron_h_moe`) is refused for now.
  llama.cpp's own converter, run with transformers 5, sees the MoE defaults transformers adds to every config
  (num_experts_per_tok) and writes dense releases as `nemotron_h_moe` with no MLP layers: a file llama.cpp
  cannot load. Here the pattern decides.
- transformers floors the Mamba time step at time_step_min (1e-3) where llama.cpp does not: it matters only
  for dt below 1e-3.
- Recurrent state per sequence and Mamba layer (f32): (d_conv - 1) x (d_inner + 2 x n_groups x d_state) +
  d_state x d_inner values (`shared.Mamba2.state_values`): Nemotron-Nano-9B-v2 (d_inner 10240, 8 groups,
  d_state 128, d_conv 4): 36,864 + 1,310,720 values = 5.14 MiB, x 27 Mamba layers.
"""

from __future__ import annotations

import dataclasses

from ....core.errors import ModelFormatError
from .shared import PERMUTE_K, PERMUTE_Q, Mamba2, check_mamba2, mamba2_mixer, mamba2_params
from .spec import A, Family, HParams, K, T, derived, refuse_true, require_activation, tensor, weight_and_bias

ARCH = "nemotron_h"
BLOCK = "backbone.layers.{bid}"
MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LISTED = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION, "mlp": MLP,
          "moe": MOE}
UNBOUNDED_CONTEXT = 2**20  # what llama.cpp's converter writes for a model without positions


def layer_kinds(hp: HParams) -> list[str]:
    pattern = hp.get("hybrid_override_pattern")
    listed = hp.get("layers_block_type")
    if isinstance(pattern, str) and set(pattern) <= set(PATTERN):
        kinds = [PATTERN[c] for c in pattern]
    elif pattern is None and isinstance(listed, list) and set(listed) <= set(LISTED):
        kinds = [LISTED[t] for t in listed]
    else:
        raise ModelFormatError(f"config.json needs hybrid_override_pattern (M, *, -, E per layer) or "
                               f"layers_block_type, got {pattern!r} / {listed!r}")
    if len(kinds) != hp.n_layers:
        raise ModelFormatError(f"config.json's layer pattern has {len(kinds)} layers, num_hidden_layers is "
                               f"{hp.n_layers}")
    return kinds


def _kind(kind: str):
    return lambda hp, bid: layer_kinds(hp)[bid] == kind


def dims(hp: HParams) -> Mamba2:
    # the spellings of released configs and of transformers 5 (which reads mamba_n_groups etc. as aliases)
    heads = int(hp.find("mamba_num_heads", default=128))
    return Mamba2(d_conv=int(hp.find("conv_kernel", "mamba_d_conv", default=4)),
                  d_inner=heads * int(hp.find("mamba_head_dim", default=64)),
                  d_state=int(hp.find("ssm_state_size", default=128)), n_heads=heads,
                  n_groups=int(hp.find("n_groups", "mamba_n_groups", default=8)))


def _per_layer(kind: str, value):
    return lambda hp: [value(hp) if k == kind else 0 for k in layer_kinds(hp)]


def _check(hp: HParams) -> None:
    kinds = layer_kinds(hp)
    if MOE in kinds:
        raise ModelFormatError(f"{ARCH} with MoE layers (pattern E) is llama.cpp's nemotron_h_moe, not supported yet")
    check_mamba2(ARCH, dims(hp))
    require_activation(hp, ARCH, "relu2", "llama.cpp's nemotron_h MLP is squared ReLU", key="mlp_hidden_act")
    require_activation(hp, ARCH, "silu", "llama.cpp's Mamba-2 gates with SiLU", key="mamba_hidden_act")
    refuse_true(hp, ARCH, "use_bias", "llama.cpp's Mamba-2 projections have no biases")
    if hp.get("use_conv_bias") is False or hp.get("mamba_conv_bias") is False:
        raise ModelFormatError(f"{ARCH} without a conv bias is not supported: llama.cpp's Mamba-2 always adds one")


ATTENTION_RULES = tuple(tensor(t, f"{BLOCK}.mixer.{hf}.weight", transform, when=_kind(ATTENTION))
                        for t, hf, transform in ((T.ATTN_Q, "q_proj", PERMUTE_Q), (T.ATTN_K, "k_proj", PERMUTE_K)))
ATTENTION_RULES += tuple(tensor(t, f"{BLOCK}.mixer.{hf}.weight", when=_kind(ATTENTION))
                         for t, hf in ((T.ATTN_V, "v_proj"), (T.ATTN_OUT, "o_proj")))
MLP_RULES = tuple(dataclasses.replace(rule, when=_kind(MLP))  # biases when mlp_bias
                  for t, hf in ((T.FFN_UP, "up_proj"), (T.FFN_DOWN, "down_proj"))
                  for rule in weight_and_bias(t, f"{BLOCK}.mixer.{hf}", bias_optional=True))

FAMILY = Family(
    name="nemotron_h",
    gguf_arch=ARCH,
    architectures=("NemotronHForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "backbone.embeddings.weight"),
        tensor(T.OUTPUT_NORM, "backbone.norm_f.weight"),
        tensor(T.OUTPUT, "lm_head.weight", optional=True),  # absent when tied
        tensor(T.ATTN_NORM, BLOCK + ".norm.weight"),
    ) + mamba2_mixer(BLOCK + ".mixer", dims, _kind(MAMBA)) + ATTENTION_RULES + MLP_RULES,
    params=mamba2_params(dims) + (
        derived(K.VOCAB_SIZE, lambda hp: hp.require("vocab_size")),
        derived(A.HEAD_COUNT_KV, _per_layer(ATTENTION, lambda hp: hp.n_head_kv), kind=list),
        derived(K.FEED_FORWARD_LENGTH, _per_layer(MLP, lambda hp: hp.require("intermediate_size")), kind=list),
        derived(K.CONTEXT_LENGTH, lambda hp: UNBOUNDED_CONTEXT),
        derived(A.KEY_LENGTH, lambda hp: hp.head_dim),
        derived(A.VALUE_LENGTH, lambda hp: hp.head_dim),
        # a dense model: transformers 5 writes its MoE defaults (n_routed_experts ...) into every config
        derived(K.EXPERT_COUNT, lambda hp: None),
        derived(K.EXPERT_USED_COUNT, lambda hp: None),
    ),
    rope=False,  # no positions at all
    check=_check,
    block_prefix="backbone.layers",
    recurrent_state=lambda hp: layer_kinds(hp).count(MAMBA) * dims(hp).state_values,
    kv_layers=lambda hp: layer_kinds(hp).count(ATTENTION),
)
