"""Vision-language models on Cloud AI 100: one declarative module per family (spec.py says what a family
declares), one export of the two graphs (export.py), one parity run (parity.py). Adding a family is a module
here plus its line in `_MODULES`, listed explicitly so that what the export supports is read in one place."""

from __future__ import annotations

from typing import Any

from ....core.errors import NotApplicableError
from . import internvl, llama4, llava, llava_next, mllama, qwen2_5_vl, qwen3_vl, qwen3_vl_moe
from .spec import VisionFamily

_MODULES = (llava, llava_next, internvl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, mllama, llama4)


def _collect() -> dict[str, VisionFamily]:
    families: dict[str, VisionFamily] = {}
    for module in _MODULES:
        for arch in module.FAMILY.architectures:
            if arch in families:
                raise RuntimeError(f"{arch} is declared twice among the AI 100 vision families (again in {module.__name__})")
            families[arch] = module.FAMILY
    return families


VISION_FAMILIES: dict[str, VisionFamily] = _collect()
ARCHITECTURES = frozenset(VISION_FAMILIES)


def vision_family(config: Any) -> tuple[str, VisionFamily]:
    """(architecture, its VisionFamily) for a transformers config or config.json's dict; one-line refusal otherwise."""
    names = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    arch = (names or ["<no architectures in config.json>"])[0]
    if arch not in VISION_FAMILIES:
        raise NotApplicableError(f"no AI 100 vision-language export for {arch} "
                                 f"(supported: {', '.join(sorted(VISION_FAMILIES))})")
    return arch, VISION_FAMILIES[arch]
