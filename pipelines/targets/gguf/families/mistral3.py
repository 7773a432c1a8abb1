"""Ministral 3 and Mistral Small 3.x (Ministral3ForCausalLM, and the language model of
Mistral3ForConditionalGeneration): llama.cpp arch `mistral3`.

A Llama block (Q and K permuted to llama.cpp's adjacent rope pairs, `shared.permute_qk`), as llama.cpp's converter
maps both architectures to `mistral3` (the wrapper's vision side is the mmproj GGUF's). What differs:

- Ministral 3 (`model_type` ministral3, also the text model of the Ministral-3 VLMs): YaRN rope and a llama-4-style
  attention temperature on every layer, queries times 1 + beta * log(1 + floor(pos / original_max_position_embeddings)),
  both in `rope_parameters`. The beta is `attention.temperature_scale` (llama.cpp floors by the YaRN original
  context); `mscale_all_dim` is `rope.scaling.yarn_log_multiplier`, from which llama.cpp recomputes the YaRN
  attention factor assuming mscale 1: a config whose own factor (explicit `attention_factor`, or mscale /
  mscale_all_dim) differs from that is refused, as is a YaRN without truncation;
- Mistral Small 3.1 / 3.2 (`model_type` mistral inside the wrapper): a plain Llama block with a large rope base;
  llama.cpp's mistral3 attends to the whole context, so a sliding window shorter than it is refused;
- Mistral Small 4 (`model_type` mistral4: MLA and MoE) is llama.cpp's `mistral4`, refused here.

The wrapper keeps the language model under `language_model.model.` / `language_model.lm_head.` (as released and as
transformers 5.23 saves it) or under `model.language_model.` (`shared.VLM_RENAMES`).
"""

from __future__ import annotations

import dataclasses
import math

from ....core.errors import ModelFormatError
from .shared import (
    EMBEDDINGS,
    NORMS,
    ROTARY_BUFFERS,
    SWIGLU,
    VISION_TENSORS,
    VLM_RENAMES,
    VOCAB_AND_ROPE_DIMS,
    attention,
    llama3_rope_freqs,
)
from .spec import A, Family, HParams, R, derived, refuse_rope, require_activation

ARCH = "mistral3"


def ministral3(hp: HParams) -> bool:
    return hp.get("model_type") == "ministral3"


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factors(hp: HParams) -> tuple[float, float]:
    """(transformers' YaRN attention factor, llama.cpp's) for this config: llama.cpp ignores an explicit factor and
    mscale, and divides by the mscale of `yarn_log_multiplier` when it is set (llama_context's yarn_attn_factor)."""
    rope = hp.rope
    factor = float(rope["factor"])
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if rope.get("attention_factor") is not None:
        ours = float(rope["attention_factor"])
    elif mscale and all_dim:
        ours = _mscale(factor, float(mscale)) / _mscale(factor, float(all_dim))
    else:
        ours = _mscale(factor, 1.0)
    log_mul = float(all_dim or 0.0) if ministral3(hp) else 0.0
    theirs = _mscale(factor, 1.0) / _mscale(factor, log_mul) if log_mul else _mscale(factor, 1.0)
    return ours, theirs


def _check(hp: HParams) -> None:
    kind = hp.get("model_type")
    if kind == "mistral4":
        raise ModelFormatError("Mistral 4 (model_type mistral4: MLA attention and MoE) is llama.cpp's mistral4 "
                               "architecture, which has no GGUF family here")
    refuse_rope(hp, ARCH, ("default", "linear", "yarn", "llama3"))
    require_activation(hp, ARCH, "silu", "llama.cpp's mistral3 runs a SwiGLU MLP")
    window, context = hp.get("sliding_window"), hp.get("max_position_embeddings")
    if window is not None and (context is None or int(window) < int(context)):
        raise ModelFormatError(f"{ARCH} with sliding_window={window} is not supported: llama.cpp's mistral3 attends "
                               f"to the whole context ({context})")
    rope = hp.rope
    if ministral3(hp):
        missing = [k for k in ("llama_4_scaling_beta", "mscale_all_dim", "original_max_position_embeddings")
                   if rope.get(k) is None]
        if rope["rope_type"] != "yarn" or missing:
            raise ModelFormatError(f"ministral3 GGUF needs a yarn rope with {', '.join(missing) or 'its parameters'} "
                                   f"in rope_parameters (llama.cpp's temperature scaling), config has "
                                   f"{rope['rope_type']!r}")
    if rope["rope_type"] == "yarn":
        if rope.get("factor") is None:
            raise ModelFormatError(f"{ARCH} GGUF needs the yarn rope's factor, rope_parameters has none")
        if rope.get("truncate") is False:
            raise ModelFormatError(f"{ARCH} with a yarn rope without truncate is not supported: llama.cpp rounds "
                                   "the correction range")
        ours, theirs = yarn_attention_factors(hp)
        if abs(ours - theirs) > 1e-6:
            raise ModelFormatError(f"{ARCH} with a yarn attention factor of {ours:.6g} is not supported: llama.cpp "
                                   f"computes {theirs:.6g} from the factor and mscale_all_dim alone")


def _ministral3_only(key: str):
    return lambda hp: hp.rope.get(key) if ministral3(hp) else None


TEXT = Family(
    name="mistral3",
    gguf_arch=ARCH,
    architectures=("Ministral3ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention() + SWIGLU,
    params=VOCAB_AND_ROPE_DIMS + (
        derived(R.SCALING_YARN_LOG_MUL, _ministral3_only("mscale_all_dim"), kind=float),
        derived(A.TEMPERATURE_SCALE, _ministral3_only("llama_4_scaling_beta"), kind=float),
    ),
    extra_tensors=llama3_rope_freqs,
    ignored=ROTARY_BUFFERS,
    check=_check,
)

# Mistral Small 3.x and the Ministral-3 VLMs: the same language model inside the wrapper.
VLM = dataclasses.replace(TEXT, name="mistral3_vlm", architectures=("Mistral3ForConditionalGeneration",),
                          renames=VLM_RENAMES, ignored=TEXT.ignored + VISION_TENSORS)

FAMILIES = (TEXT, VLM)  # FAMILIES, not FAMILY: the registry reads FAMILY alone when a module has one
