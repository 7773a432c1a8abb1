"""How each parameter of a transformers model is made from checkpoint tensors.

Checkpoint names map onto parameter names one to one, except where a checkpoint keeps a module under
another name (`MODULE_RENAMES`), was saved from the base model (no `model.` prefix), ties the output
embedding to the input one, or stores per-expert MoE weights that transformers 5 fuses into stacked
tensors (Mixtral, Qwen2/3-MoE: stacked here as transformers stacks them when it loads them). A
remote-code architecture with a native equivalent (native.py) translates its names through that.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.errors import ModelFormatError

if TYPE_CHECKING:
    from .native import NativeEquivalent

# Per-expert checkpoint layouts (module under the layer, gate, up, down) that transformers 5 stacks
# into `<layer>.mlp.experts.gate_up_proj` [E, 2I, H] and `.down_proj` [E, H, I].
EXPERT_LAYOUTS = (("block_sparse_moe", "w1", "w3", "w2"), ("mlp", "gate_proj", "up_proj", "down_proj"),
                  ("feed_forward", "w1", "w3", "w2"))  # LFM2-MoE's experts are `<layer>.feed_forward.experts`
# Bytes of a checkpoint tensor widened to fp32 at a time (and then dropped from the resident set).
READ_SLICE_BYTES = 16 << 20
# Whole-module renames between checkpoint and model (Mixtral's router lives in block_sparse_moe; GPT-NeoX's
# checkpoints name the output embedding embed_out, transformers 5 names it lm_head; Granite MoE checkpoints keep
# JetMoE's names for their router and stacked experts, as transformers' conversion mapping says).
MODULE_RENAMES = ((".mlp.", ".block_sparse_moe."), ("lm_head.", "embed_out."),
                  (".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight"),
                  (".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
                  (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
                  # ERNIE 4.5 MoE keeps its routing bias beside the router, transformers 5 inside it
                  (".mlp.gate.moe_statics.", ".mlp.moe_statics."))


# Vision-language checkpoints in the layout before transformers 5 (which its save_pretrained still writes) keep
# the language model, the vision tower and the projector at the top level (llava-1.5-7b-hf:
# `language_model.model.layers.0...`; Qwen2.5-VL: `model.layers.0...`, `visual.`); transformers 5 nests them
# under `model.` (its conversion mappings): (model prefix, checkpoint prefix), the first that exists wins.
VLM_PREFIXES = (("model.language_model.", "language_model.model."), ("model.language_model.", "language_model."),
                ("model.language_model.", "model."), ("lm_head.", "language_model.lm_head."),
                # a CLIP / SigLIP tower as released (llava-1.5, Gemma 3) keeps its transformer under `vision_model.`
                ("model.vision_tower.", "vision_tower.vision_model."),
                ("model.vision_tower.", "model.vision_tower.vision_model."),
                ("model.vision_tower.", "vision_tower."), ("model.vision_model.", "vision_model."),
                ("model.visual.", "visual."), ("model.multi_modal_projector.", "multi_modal_projector."),
                ("model.image_newline", "image_newline"))

# Checkpoints that keep the decoder trunk under another name than transformers 5's `model.` (Nemotron-H as released
# and as transformers 5.23 saves it: `backbone.embeddings`, `backbone.layers.N.mixer`, `backbone.norm_f`).
TRUNK_PREFIXES = (("model.", "backbone."),)


@dataclass(frozen=True)
class WeightRule:
    """How one model parameter is made from checkpoint tensors: `sources` read, then `combine`d."""

    sources: tuple[str, ...]
    combine: Callable[[list], object] | None = None  # None: the single source as it is

    def load(self, read: Callable[[str], object]):
        parts = [read(s) for s in self.sources]
        return parts[0] if self.combine is None else self.combine(parts)


def _stack_gate_up(n_experts: int):
    def combine(parts):
        import torch

        gates, ups = parts[:n_experts], parts[n_experts:]
        return torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gates, ups)])
    combine.stacks_gate_up = True  # expert e is cat(source e, source n + e): expert_stream reads one at a time
    return combine


def _stack(parts):
    import torch

    return torch.stack(parts)


_stack.stacks = True  # expert e is source e (expert_stream)


# E2M1 code -> value (sign bit 8): MXFP4 elements, each times its block's power of two (E8M0 scale, bias 127).
MXFP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(parts):
    """(`<param>_blocks` [E, R, n, 16] uint8, `<param>_scales` [E, R, n] uint8) -> the float32 parameter
    [E, n * 32, R], as transformers dequantizes MXFP4 experts when it loads them (gpt-oss as released): element
    2j in byte j's low nibble, 2j + 1 in its high one, times 2^(scale - 127), then rows and columns swapped."""
    import torch

    blocks, scales = (p.to(torch.uint8) for p in parts)
    if blocks.shape[:-1] != scales.shape or scales.dim() != 3:
        raise ModelFormatError(f"MXFP4 blocks {list(blocks.shape)} do not match their scales {list(scales.shape)}")
    lut = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    experts, rows, n = scales.shape
    out = torch.empty(experts, n * 32, rows, dtype=torch.float32)
    for e in range(experts):  # expert by expert: the index and value temporaries stay one expert's size
        values = torch.stack([lut[(blocks[e] & 0x0F).long()], lut[(blocks[e] >> 4).long()]], dim=-1).flatten(-2)
        out[e] = torch.ldexp(values, (scales[e].to(torch.int32) - 127).unsqueeze(-1)).flatten(-2).T
    return out


dequantize_mxfp4.mxfp4 = True  # expert by expert too (expert_stream): its inputs' first axis is the expert


def weight_rules(param_names: list[str], checkpoint: set[str], tied: dict[str, str],
                 native: tuple[NativeEquivalent, dict] | None = None) -> dict[str, WeightRule]:
    """The rule for every parameter; ModelFormatError naming what no checkpoint tensor provides. `native`: the
    native equivalent of a remote-code architecture and its repository config, whose names it translates."""
    rules: dict[str, WeightRule] = {}
    missing = []
    for name in param_names:
        rule = _native_rule(name, checkpoint, tied, *native) if native else _rule_for(name, checkpoint, tied)
        if rule is None:
            missing.append(name)
        else:
            rules[name] = rule
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(f"the checkpoint has no tensor for {', '.join(missing[:3])}{more}")
    return rules


def _rule_for(name: str, checkpoint: set[str], tied: dict[str, str]) -> WeightRule | None:
    candidates = [name]
    for model_part, ckpt_part in MODULE_RENAMES:
        if model_part in name:
            candidates.append(name.replace(model_part, ckpt_part))
    if "." in name:  # checkpoints saved from the base model lack its prefix (`transformer.`, `model.`)
        candidates.append(name.split(".", 1)[1])
    candidates += [ckpt + name[len(model_prefix):] for model_prefix, ckpt in VLM_PREFIXES + TRUNK_PREFIXES
                   if name.startswith(model_prefix)]
    for c in candidates:
        if c in checkpoint:
            return WeightRule((c,))
    if f"{name}_blocks" in checkpoint and f"{name}_scales" in checkpoint:  # MXFP4 experts (gpt-oss as released)
        return WeightRule((f"{name}_blocks", f"{name}_scales"), dequantize_mxfp4)
    m = re.fullmatch(r"(.*)\.(?:mlp|feed_forward)\.experts\.(gate_up_proj|down_proj)", name)
    if m:
        layer, which = m.groups()
        for moe, gate, up, down in EXPERT_LAYOUTS:
            n = 0
            while f"{layer}.{moe}.experts.{n}.{gate}.weight" in checkpoint:
                n += 1
            if n == 0:
                continue
            expert = f"{layer}.{moe}.experts.{{}}.{{}}.weight"
            if which == "down_proj":
                rule = WeightRule(tuple(expert.format(e, down) for e in range(n)), _stack)
            else:
                rule = WeightRule(tuple(expert.format(e, gate) for e in range(n)) + tuple(expert.format(e, up) for e in range(n)),
                                  _stack_gate_up(n))
            # every expert's every projection, or the parameter is missing (the experts are counted by their gates)
            return rule if all(src in checkpoint for src in rule.sources) else None
    if name in tied:
        return _rule_for(tied[name], checkpoint, {})
    return None


def _native_rule(name: str, checkpoint: set[str], tied: dict[str, str], eq: NativeEquivalent,
                 cfg: dict) -> WeightRule | None:
    from .native import checkpoint_source

    found = checkpoint_source(eq, name, cfg)
    if found is not None and found[0] in checkpoint:
        source, take = found
        return WeightRule((source,), None if take is None else (lambda parts, take=take: take(parts[0]).contiguous()))
    if name in tied:
        return _native_rule(tied[name], checkpoint, {}, eq, cfg)
    return None
