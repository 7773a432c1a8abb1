"""Qwen3-VL language model (Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration): llama.cpp arch
`qwen3vl` (`qwen3vlmoe` for the MoE).

Qwen3's layout and weights (q_norm / k_norm, NEOX halves, nothing permuted; head_dim its own setting) inside a
vision-language wrapper:

- the rope is interleaved M-RoPE: rotary pairs cycle through the time, height and width positions (llama.cpp's
  IMROPE, implied by the arch), with `rope.dimension_sections` [t, h, w, 0] from `mrope_section`
  (transformers' default [24, 20, 20]), which llama.cpp requires. On text alone the three positions are equal and
  the model computes Qwen3's rope;
- DeepStack: the vision tower's features from `vision_config.deepstack_visual_indexes` are added to the hidden
  states after the first language layers. llama.cpp widens its input embeddings by that many extra rows
  (`n_deepstack_layers`, written from the vision config) and adds them after layers 0..n-1; for text tokens they
  are zero, as in transformers;
- the language model under `model.language_model.*` (as released and as transformers 5 writes it) with the head
  at `lm_head.*` (`shared.VLM_RENAMES`); the vision tower (`model.visual.*`) goes to the projector's GGUF;
- Qwen3-VL-MoE: Qwen3-MoE's layers (a softmax top-k router that always renormalizes, every layer MoE) with the
  experts FUSED: `mlp.experts.gate_up_proj` and `down_proj`, released as [E, H, 2I] / [E, I, H] (inputs first,
  which llama.cpp's converter assumes) and saved by transformers 5 as [E, 2I, H] / [E, H, I] (its conversion
  transposes them on load). Both go to llama.cpp's [E, I, H] gate and up and [E, H, I] down, told apart by shape
  as transformers does (a square one is taken as transformers 5's), streamed expert by expert.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ....core.errors import ModelFormatError
from .qwen3 import FAMILY as QWEN3
from .shared import EMBEDDINGS, LAYER, NORMS, QK_NORMS, VISION_TENSORS, VLM_RENAMES, attention, dense_layers, rope_sections
from .spec import IDENTITY, HParams, K, R, Rule, T, Transform, derived, name, param, refuse_rope, tensor

DEFAULT_SECTIONS = (24, 20, 20)  # transformers' Qwen3-VL text rotary embedding without an mrope_section


def deepstack_layers(hp: HParams) -> int:
    """How many DeepStack levels the vision tower feeds into the language model."""
    return len((hp.get("vision_config") or {}).get("deepstack_visual_indexes") or ())


def _check(hp: HParams) -> None:
    refuse_rope(hp, "qwen3vl", ("default",))
    rope_sections(hp, DEFAULT_SECTIONS)


QWEN3VL = dataclasses.replace(
    QWEN3,
    name="qwen3vl",
    gguf_arch="qwen3vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    params=(
        derived(R.DIMENSION_SECTIONS, lambda hp: rope_sections(hp, DEFAULT_SECTIONS), kind=list),
        derived(K.NUM_DEEPSTACK_LAYERS, deepstack_layers),
    ),
    ignored=QWEN3.ignored + VISION_TENSORS,
    renames=VLM_RENAMES,
    check=_check,
)


def _released(x_shape, hp: HParams, rows: int) -> bool:
    """Whether a fused expert tensor is stored inputs-first ([E, H, rows], as released) rather than transformers 5's
    [E, rows, H]; a square one is taken as transformers 5's, as its conversion does."""
    hidden = hp.hidden
    if tuple(x_shape[1:]) == (rows, hidden):
        return False
    if tuple(x_shape[1:]) == (hidden, rows):
        return True
    raise ModelFormatError(f"fused experts {list(x_shape)} are neither [experts, {rows}, {hidden}] nor "
                           f"[experts, {hidden}, {rows}]")


def _moe_width(hp: HParams) -> int:
    return int(hp.require("moe_intermediate_size"))


def _gate_or_up(which: int) -> Transform:
    """gate_up_proj -> gate (0: the first half of its 2I) or up (1), as [E, I, H]."""
    def apply(xs, hp):
        x, width = xs[0], _moe_width(hp)
        if _released(x.shape, hp, 2 * width):
            return [np.ascontiguousarray(x[:, :, which * width:(which + 1) * width].transpose(0, 2, 1))]
        return [np.ascontiguousarray(x[:, which * width:(which + 1) * width, :])]

    def shapes(s, hp):
        if len(s[0]) != 3:
            raise ModelFormatError(f"fused gate_up_proj {list(s[0])} is not [experts, ., .]")
        _released(s[0], hp, 2 * _moe_width(hp))
        return [(s[0][0], _moe_width(hp), hp.hidden)]

    return Transform(("experts_gate", "experts_up")[which], apply, shapes, sliced=True)


def _down_released(x_shape, hp: HParams) -> bool:
    """down_proj [E, I, H] as released (its inputs first), [E, H, I] as transformers 5 saves it."""
    return _released((x_shape[0], x_shape[2], x_shape[1]), hp, _moe_width(hp))


def _down_apply(xs, hp):
    x = xs[0]
    return [np.ascontiguousarray(x.transpose(0, 2, 1)) if _down_released(x.shape, hp) else x]


def _down_shapes(s, hp):
    if len(s[0]) != 3:
        raise ModelFormatError(f"fused down_proj {list(s[0])} is not [experts, ., .]")
    _down_released(s[0], hp)
    return [(s[0][0], hp.hidden, _moe_width(hp))]


EXPERTS = (
    tensor(T.FFN_GATE_INP, LAYER + ".mlp.gate.weight"),
    Rule((name(T.FFN_GATE_EXP),), (LAYER + ".mlp.experts.gate_up_proj",), _gate_or_up(0)),
    Rule((name(T.FFN_UP_EXP),), (LAYER + ".mlp.experts.gate_up_proj",), _gate_or_up(1)),
    Rule((name(T.FFN_DOWN_EXP),), (LAYER + ".mlp.experts.down_proj",),
         Transform("experts_down", _down_apply, _down_shapes, sliced=True)),
)


def _check_moe(hp: HParams) -> None:
    _check(hp)
    dense = dense_layers(hp)
    if dense:
        raise ModelFormatError(f"qwen3vlmoe GGUF: layers {dense} are dense (mlp_only_layers / decoder_sparse_step), "
                               "but llama.cpp runs every qwen3vlmoe layer as MoE")


QWEN3VL_MOE = dataclasses.replace(
    QWEN3VL,
    name="qwen3vlmoe",
    gguf_arch="qwen3vlmoe",
    architectures=("Qwen3VLMoeForConditionalGeneration",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + QK_NORMS + EXPERTS,
    params=QWEN3VL.params + (param(K.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size"),),
    check=_check_moe,
)
FAMILIES = (QWEN3VL, QWEN3VL_MOE)
