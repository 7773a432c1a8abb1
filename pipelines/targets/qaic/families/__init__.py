"""What the AI 100 export needs to know about each decoder family: one declarative module per family.

Each family module names its `ARCHITECTURES` and its `FAMILY`: a `Family` (spec.py), or a function of the
transformers config where the layout depends on it (Falcon, GPTBigCode). The layout blocks they pick from
(norms, q/k/v splits, RoPE tables, MLPs, MoE) are in blocks.py; the one decoder engine that reads the
declarations is decoder.py. Adding a family is a module here plus its line in `_MODULES`, listed explicitly so
that what the export supports is read in one place, not discovered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ....core.errors import NotApplicableError
from . import (
    falcon,
    gemma,
    gemma2,
    gpt2,
    gpt_bigcode,
    gpt_oss,
    gptj,
    granite,
    llama,
    llama4,
    mixtral,
    mllama,
    olmo2,
    phi3,
    qwen2_5_vl,
    qwen3,
    qwen3_moe,
    qwen3_vl,
    qwen3_vl_moe,
    starcoder2,
)
from .llama import LLAMA
from .spec import Family, Moe, Norms

_MODULES = (llama, qwen3, gemma, gemma2, phi3, granite, olmo2, starcoder2, gpt2, gptj, gpt_bigcode, falcon, mixtral,
            qwen3_moe, gpt_oss, llama4)
# language models of vision-language models only (vision/): found by family_for, never exported on their own (the
# Qwen VLMs' names are this export's own, set by the vision family on the text config)
_LANGUAGE_MODULES = (qwen2_5_vl, qwen3_vl, qwen3_vl_moe, mllama)


def _collect(modules=_MODULES) -> dict[str, Family | Callable[[Any], Family]]:
    specs: dict[str, Family | Callable[[Any], Family]] = {}
    for module in modules:
        for arch in module.ARCHITECTURES:
            if arch in specs:
                raise RuntimeError(f"{arch} is declared twice among the AI 100 families (again in {module.__name__})")
            specs[arch] = module.FAMILY
    return specs


FAMILY_SPECS: dict[str, Family | Callable[[Any], Family]] = _collect()
LANGUAGE_SPECS: dict[str, Family | Callable[[Any], Family]] = _collect(_LANGUAGE_MODULES)
# a family that is also a VLM's language model names its text model_type (a VLM's text config names no architecture)
TEXT_MODEL_TYPES: dict[str, Family | Callable[[Any], Family]] = {
    model_type: module.FAMILY for module in _MODULES for model_type in getattr(module, "TEXT_MODEL_TYPES", ())}


def unsupported(arch: str) -> Exception:
    """The one-line refusal of an architecture without a declaration here."""
    return NotApplicableError(f"no AI 100 ONNX export for {arch} (supported: {', '.join(sorted(FAMILY_SPECS))})")


def architecture(config: Any) -> str:
    """The architecture named first in a config (a transformers config or config.json's dict)."""
    names = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    return (names or ["<no architectures in config.json>"])[0]


def family_for(config: Any) -> tuple[str, Family]:
    """(architecture, its Family) for a transformers config; NotApplicableError (one line) when unsupported."""
    arch = architecture(config)
    spec = FAMILY_SPECS.get(arch) or LANGUAGE_SPECS.get(arch)
    if spec is None:
        raise unsupported(arch)
    return arch, spec if isinstance(spec, Family) else spec(config)


def window_served_full(config: dict[str, Any]) -> int | None:
    """The sliding window config.json declares that the export computes as full attention (a family declared
    `sliding=False`: Gemma 2, as vLLM serves it on AI 100); None where the export honors the window or there
    is none. The server is then told so (`disable_sliding_window`) and sequences must stay within the window,
    where full attention equals the model. Declarations that depend on the config (Falcon, GPTBigCode) keep
    the default, honoring any window."""
    spec = FAMILY_SPECS.get(architecture(config))
    window = config.get("sliding_window")
    if not isinstance(spec, Family) or spec.sliding or not isinstance(window, int) or window <= 0:
        return None
    return window


def positions_served(config: dict[str, Any]) -> int | None:
    """The positions a family's export serves at most where it declares fewer than config.json (Llama 4 declares
    10M positions; its RoPE table stops at QEfficient's 65536), for the causal LM or a VLM's text config; None
    where the config's max_position_embeddings holds."""
    text = config.get("text_config")
    spec = FAMILY_SPECS.get(architecture(config))
    if spec is None and isinstance(text, dict):
        spec = TEXT_MODEL_TYPES.get(text.get("model_type"))
    return spec.max_positions if isinstance(spec, Family) else None


def matmul_weights(model: Any) -> list[tuple[Any, str, int]]:
    """Every weight the exported graph multiplies as a constant MatMul operand (what `-mxfp6-matmul`
    compresses), as (module, parameter name, reduction axis): nn.Linear weights (axis -1), GPT-2 Conv1D
    weights ([in, out]: axis 0), MoE routers (axis -1) and stacked expert weights (the axis their expert
    layout reduces over). Embeddings are Gathers, norms and biases are not MatMul weights."""
    import torch

    _arch, fam = family_for(model.config)
    found: list[tuple[Any, str, int]] = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            found.append((module, "weight", -1))
        elif type(module).__name__ == "Conv1D" and module.weight.dim() == 2:
            found.append((module, "weight", 0))
    if fam.moe is not None:
        for layer in getattr(getattr(model, fam.base), fam.layers):
            ffn = getattr(layer, fam.ffn)
            experts = getattr(ffn, fam.moe.experts, None)
            if experts is None:
                continue
            router = getattr(ffn, fam.moe.router)
            if not isinstance(router, torch.nn.Linear):
                found.append((router, "weight", -1))
            axis = fam.moe.layout.reduction_axis
            found += [(experts, "gate_up_proj", axis), (experts, "down_proj", axis)]
    return found


__all__ = ["FAMILY_SPECS", "LANGUAGE_SPECS", "LLAMA", "Family", "Moe", "Norms", "architecture", "family_for",
           "matmul_weights", "positions_served", "unsupported", "window_served_full"]
