"""Granite 4 (GraniteMoeHybridForCausalLM): llama.cpp arch `granitehybrid`; without Mamba layers, `granite`.

Granite 4.0-H interleaves Mamba-2 layers with a few attention layers (`layer_types`: "mamba" / "attention" as
released, "linear_attention" / "full_attention" as transformers 5 saves them). Every layer has Granite's MLP
side: routed experts stacked JetMoE style (`granitemoe.py`: input_linear split into gate and up, the router
`router.layer`) plus a shared SwiGLU MLP `shared_mlp.input_linear` = [gate; up] (h-tiny, h-small), or the
shared MLP alone when `num_local_experts` is 0 (h-micro): then it is the layer's dense MLP (ffn_gate/up/down)
and its width is `shared_intermediate_size`. The four Granite multipliers are keys, as for `granite`.

- Mamba-2 (`shared.mamba2_mixer`): in_proj, conv1d squeezed to [channels, kernel] (f32), dt_bias as ssm_dt's
  bias, A = -exp(A_log) and D as [heads, 1] columns, the gated RMS norm as [groups, d_inner / groups].
  llama.cpp's graph asserts d_inner == 2 x hidden (mamba_expand 2) and always adds a conv bias.
- A layer is recurrent in llama.cpp when its `attention.head_count_kv` entry is 0: a per-layer list.
- Positions: `position_embedding_type` "nope" (every released 4.0-H) runs attention without rope, which
  llama.cpp reads from `rope.scaling.finetuned` = false; "rope" sets it true (Q/K permuted as for Llama either
  way, as llama.cpp's converter does, which writes false for every hybrid). Without rope the context length
  is llama.cpp's converter's unbounded 2^20.
- granite-4.0-micro has no Mamba layer: llama.cpp's converter writes it as a dense `granite` model (`variant`).
- Recurrent state per sequence and Mamba layer (f32): (d_conv - 1) x (d_inner + 2 x groups x d_state) conv
  values + d_state x d_inner SSM values (`shared.Mamba2.state_values`). granite-4.0-h-small (hidden 4096,
  d_inner 8192, 1 group, d_state 128, d_conv 4): 25,344 + 1,048,576 values = 4.10 MiB, x 36 Mamba layers.
"""

from __future__ import annotations

import dataclasses

from ....core.errors import ModelFormatError
from .granitemoe import FAMILY as GRANITEMOE, SPARSE_MOE
from .shared import EMBEDDINGS, LAYER, NORMS, Mamba2, attention, check_mamba2, mamba2_mixer, mamba2_params
from .spec import A, Family, HParams, K, R, Rule, T, derived, name, refuse_rope, require_activation, split_rows

ARCH = "granitehybrid"
MAMBA, ATTENTION = "mamba", "attention"
KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}
UNBOUNDED_CONTEXT = 2**20  # what llama.cpp's converter writes for a model without positions


def layer_kinds(hp: HParams) -> list[str]:
    """Each layer's mixer; transformers' default without `layer_types` is Mamba everywhere."""
    types = hp.get("layer_types")
    if types is None:
        return [MAMBA] * hp.n_layers
    if not isinstance(types, list) or len(types) != hp.n_layers or any(t not in KINDS for t in types):
        raise ModelFormatError(f"config.json layer_types must name mamba or attention for each of the "
                               f"{hp.n_layers} layers, got {types!r}")
    return [KINDS[t] for t in types]


def is_mamba(hp: HParams, bid: int) -> bool:
    return layer_kinds(hp)[bid] == MAMBA


def is_attention(hp: HParams, bid: int) -> bool:
    return layer_kinds(hp)[bid] == ATTENTION


def dims(hp: HParams) -> Mamba2:
    # transformers' defaults where a config omits a size
    return Mamba2(d_conv=int(hp.get("mamba_d_conv", 4)), d_inner=int(hp.get("mamba_expand", 2)) * hp.hidden,
                  d_state=int(hp.get("mamba_d_state", 256)), n_heads=int(hp.get("mamba_n_heads", 128)),
                  n_groups=int(hp.get("mamba_n_groups", 1)))


def experts(hp: HParams) -> int:
    return int(hp.get("num_local_experts", 8) or 0)  # transformers' default 8; 0: the shared MLP alone


def has_experts(hp: HParams, bid: int = 0) -> bool:
    return experts(hp) > 0


def is_dense(hp: HParams, bid: int = 0) -> bool:
    return experts(hp) == 0


def uses_rope(hp: HParams) -> bool:
    return hp.get("position_embedding_type") == "rope"


def shared_width(hp: HParams) -> int:
    return int(hp.get("shared_intermediate_size", 1024))  # transformers' default


def _shared_halves(hp: HParams) -> tuple[int, int]:
    return shared_width(hp), shared_width(hp)


SPLIT_SHARED = split_rows("split_shared_gate_up", _shared_halves)
SHARED_MLP = LAYER + ".shared_mlp"


def shared_mlp(gate: T, up: T, down: T, when=None) -> tuple[Rule, ...]:
    """The shared MLP: [gate; up] rows split, as the shared expert beside routed experts or as the dense MLP."""
    return (Rule((name(gate), name(up)), (SHARED_MLP + ".input_linear.weight",), SPLIT_SHARED, when=when),
            Rule((name(down),), (SHARED_MLP + ".output_linear.weight",), when=when))


def _only(rules: tuple[Rule, ...], when) -> tuple[Rule, ...]:
    return tuple(dataclasses.replace(r, when=when) for r in rules)


def _expert_keys(hp: HParams):
    return None if is_dense(hp) else experts(hp)  # llama.cpp asserts no experts used when it has none


DENSE_KEYS = (
    derived(K.EXPERT_COUNT, _expert_keys),
    derived(K.EXPERT_USED_COUNT, lambda hp: None if is_dense(hp) else hp.get("num_experts_per_tok", 2)),
    # the dense MLP is the shared one: its width, not the experts' intermediate_size
    derived(K.FEED_FORWARD_LENGTH, lambda hp: shared_width(hp) if is_dense(hp) else hp.require("intermediate_size")),
)


def _check_common(hp: HParams, arch: str) -> None:
    GRANITEMOE.check(hp)  # head_dim == hidden / heads
    require_activation(hp, arch, "silu", "llama.cpp runs SwiGLU MLPs and SiLU-gated Mamba layers")
    if hp.get("position_embedding_type") not in (None, "nope", "rope"):
        raise ModelFormatError(f"{arch} with position_embedding_type {hp.get('position_embedding_type')!r} is not "
                               "supported: llama.cpp runs rope or no positions")
    refuse_rope(hp, arch)


def _number(value) -> float:
    # transformers 5 writes non-finite floats as {"__float__": "Infinity"}
    return float(value["__float__"] if isinstance(value, dict) and "__float__" in value else value)


def _check(hp: HParams) -> None:
    _check_common(hp, ARCH)
    kinds = layer_kinds(hp)
    m = dims(hp)
    check_mamba2(ARCH, m)
    if m.d_inner != 2 * hp.hidden:
        raise ModelFormatError(f"{ARCH} with mamba_expand={hp.get('mamba_expand')} is not supported: llama.cpp's "
                               "graph runs Mamba layers of inner size 2 x hidden_size only")
    head = hp.get("mamba_d_head", "auto")
    if head not in (None, "auto") and int(head) * m.n_heads != m.d_inner:
        raise ModelFormatError(f"{ARCH}: mamba_d_head {head} x mamba_n_heads {m.n_heads} is not the inner size "
                               f"{m.d_inner}")
    if hp.get("mamba_conv_bias") is False or hp.get("mamba_proj_bias"):
        raise ModelFormatError(f"{ARCH} needs mamba_conv_bias=true and mamba_proj_bias=false: llama.cpp's Mamba-2 "
                               "always adds a conv bias and has no projection biases")
    limit = [_number(v) for v in hp.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        raise ModelFormatError(f"{ARCH} with time_step_limit {list(limit)} is not supported: llama.cpp never "
                               "clamps the Mamba time step")
    if MAMBA not in kinds and has_experts(hp):
        raise ModelFormatError(f"{ARCH} without Mamba layers but with experts is not supported: llama.cpp's converter "
                               "writes it as granitemoe with a shared expert, untested here")


def _granite_variant(hp: HParams) -> Family | None:
    """A config without Mamba layers (granite-4.0-micro) is a dense Granite, as llama.cpp's converter writes it."""
    return None if MAMBA in layer_kinds(hp) or has_experts(hp) else GRANITE


def _check_granite(hp: HParams) -> None:
    _check_common(hp, "granite")
    if not is_dense(hp):
        raise ModelFormatError("granite GGUF from GraniteMoeHybrid needs num_local_experts 0 (no Mamba layers)")


FAMILY = Family(
    name="granitehybrid",
    gguf_arch=ARCH,
    architectures=("GraniteMoeHybridForCausalLM",),
    tensors=EMBEDDINGS + NORMS + _only(attention(), is_attention) + mamba2_mixer(LAYER + ".mamba", dims, is_mamba)
    + _only(SPARSE_MOE, has_experts) + shared_mlp(T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP, has_experts)
    + shared_mlp(T.FFN_GATE, T.FFN_UP, T.FFN_DOWN, is_dense),
    params=GRANITEMOE.params + DENSE_KEYS + mamba2_params(dims) + (
        derived(A.HEAD_COUNT_KV, lambda hp: [hp.n_head_kv if k == ATTENTION else 0 for k in layer_kinds(hp)],
                kind=list),
        derived(K.EXPERT_SHARED_FEED_FORWARD_LENGTH, shared_width),
        derived(R.SCALING_FINETUNED, uses_rope, kind=bool),  # llama.cpp's switch for rope in this arch
        derived(K.CONTEXT_LENGTH, lambda hp: hp.get("max_position_embeddings") if uses_rope(hp) else UNBOUNDED_CONTEXT),
    ),
    extra_tensors=GRANITEMOE.extra_tensors,
    ignored=GRANITEMOE.ignored,
    check=_check,
    variant=_granite_variant,
    recurrent_state=lambda hp: layer_kinds(hp).count(MAMBA) * dims(hp).state_values,
    kv_layers=lambda hp: layer_kinds(hp).count(ATTENTION),
)

# granite-4.0-micro: every layer attention, the shared MLP as the dense one. Reached through FAMILY.variant only.
GRANITE = Family(
    name="granitehybrid-dense",
    gguf_arch="granite",
    architectures=(),
    tensors=EMBEDDINGS + NORMS + attention() + shared_mlp(T.FFN_GATE, T.FFN_UP, T.FFN_DOWN),
    params=GRANITEMOE.params + DENSE_KEYS,
    extra_tensors=GRANITEMOE.extra_tensors,
    ignored=GRANITEMOE.ignored,
    check=_check_granite,
)
