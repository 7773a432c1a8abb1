"""A vision-language model streamed from its checkpoint (streamed_model.StreamedCausalLM builds a VLM as it builds a
causal LM): what the VLM checks need beside the decoder's machinery.

- the vision side (tower, projector, learned image rows: everything outside the language model) is small (0.3 B
  parameters for LLaVA's CLIP, under 1 B for Llama 3.2 Vision's) and read by code that does not always call the
  modules owning it (LLaVA-NeXT's `image_newline`): it is held resident for the whole check (`vision_side`);
- the language model streams unit by unit (or stays resident when it fits), as a decoder's reference does;
- `transform`: what a parameter becomes as it loads: the language matrices rounded as the export stores them
  (parity), or the device's emulation (quality: fp16 vision weights, MXFP6 / fp16 language weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .export import language_module_ids, vision_side_ids
from .spec import VisionFamily


def vision_units(lm, family: VisionFamily) -> list[Any]:
    """The streamed model's units the vision side reads (export.vision_side_ids): those outside its language model,
    and the language units holding a module the vision module runs (Mllama's cross layers)."""
    vision = vision_side_ids(family, lm.model)
    return [module for _prefix, module, recurse in lm.units
            if any(id(m) in vision for m in (module.modules() if recurse else (module,)))]


@contextmanager
def vision_side(lm, family: VisionFamily) -> Iterator[None]:
    """The vision side loaded (and kept) while the block runs."""
    with lm.loaded(*vision_units(lm, family)):
        yield


def split_transform(lm, family: VisionFamily, vision: Callable | None, language: Callable | None):
    """A load-time transform applying `vision` to the vision graph's parameters (export.vision_side_ids: the language
    modules it runs itself included, as the vision QPC computes them) and `language` (a streamed model's transform,
    e.g. quality.mx_transform) to the language graph's; None leaves that side as read."""
    language_ids = language_module_ids(family, lm.model) - vision_side_ids(family, lm.model)  # the language graph's

    def transform(name, owner, attr, value):
        if id(owner) in language_ids:
            return value if language is None else language(name, owner, attr, value)
        return value if vision is None else vision(value)
    return transform


def stored_rounding(weight_dtype: str):
    """The language matrices as the export stores them (float16, clipped to its range; vectors stay fp32)."""
    from ..external_data import FP16_MAX, stored_dtype

    def transform(_name, _owner, _attr, value):
        if stored_dtype(value.dim(), weight_dtype) == "float16":
            return value.clamp(-FP16_MAX, FP16_MAX).half().float()
        return value
    return transform
