"""Qwen2-VL and Qwen2.5-VL language models (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration):
llama.cpp arch `qwen2vl`.

Qwen2's layout and weights (q/k/v biases, NEOX rope, nothing permuted) inside a vision-language wrapper:

- the rope is multimodal (M-RoPE): each rotary pair turns by the time, height or width position of its token, in
  contiguous sections `rope_scaling.mrope_section` (transformers' default [16, 24, 24]), written as
  `rope.dimension_sections` [t, h, w, 0], which llama.cpp requires. On text alone the three positions are equal,
  so the model computes Qwen2's rope there. Released configs name the rope type "mrope" (transformers 5:
  "default"); any other scaling is refused;
- the language model sits at the top level as released (`model.*`, `lm_head.*`, the vision tower in `visual.*`)
  or under `model.language_model.*` as transformers 5 nests it (`shared.VLM_RENAMES`). The vision tower and the
  merger are left to the projector's GGUF (`mmproj`).
"""

from __future__ import annotations

import dataclasses

from ....core.errors import ModelFormatError
from .qwen2 import FAMILY as QWEN2
from .shared import VISION_TENSORS, VLM_RENAMES, rope_sections
from .spec import HParams, R, derived

DEFAULT_SECTIONS = (16, 24, 24)  # transformers' Qwen2(.5)-VL rotary embedding without an mrope_section


def _check(hp: HParams) -> None:
    kind = hp.rope["rope_type"]
    if kind not in ("default", "mrope"):
        raise ModelFormatError(f"rope scaling type {kind!r} is not supported for qwen2vl GGUF yet")
    rope_sections(hp, DEFAULT_SECTIONS)


FAMILY = dataclasses.replace(
    QWEN2,
    name="qwen2vl",
    gguf_arch="qwen2vl",
    architectures=("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
    params=(
        derived(R.DIMENSION_SECTIONS, lambda hp: rope_sections(hp, DEFAULT_SECTIONS), kind=list),
        derived(R.FREQ_BASE, lambda hp: hp.rope["rope_theta"], kind=float),
    ),
    rope=False,  # "mrope" is no scaling llama.cpp knows: the base alone, above
    ignored=QWEN2.ignored + VISION_TENSORS,
    renames=VLM_RENAMES,
    check=_check,
)
