"""Does a checkpoint hold what its config.json describes, under the names the engines load it by?

A checkpoint as released often names its tensors otherwise than transformers 5's modules: MoE experts one
tensor per expert (`mlp.experts.3.gate_proj.weight`) where transformers stacks them into
`mlp.experts.gate_up_proj`, Nemotron-H's trunk under `backbone.`, a VLM's language model at the top level.
transformers maps those names when it loads, and vLLM's loaders take the names as released. So the check
asks the same question transformers' loading answers: `weight_rules` (pipelines/model/weight_rules.py, the
rules the streamed reference loads by) says which stored tensors make each parameter, and the shapes are
checked through the same rules on the meta device (nothing is read or allocated). The prepared directory
keeps the names as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.errors import ModelFormatError

if TYPE_CHECKING:
    from ...model.weight_rules import WeightRule
    from ...source.safetensors_io import TensorSource


@dataclass
class CheckpointMap:
    """The meta-device model of a checkpoint's config and, for each of its parameters, the stored tensors it is
    made from. `unknown`: stored tensors no parameter is made from (reported, not refused: rotary caches, a
    NextN layer transformers does not build)."""

    model: object
    rules: dict[str, WeightRule]
    unknown: list[str]

    def sources(self, param: str) -> tuple[str, ...]:
        rule = self.rules.get(param)
        return rule.sources if rule is not None else ()


def map_checkpoint(model_dir: Path, src: TensorSource) -> CheckpointMap:
    """The checkpoint's map, after refusing weights that lack a parameter the config requires or whose shapes
    do not match it (vLLM would fail at load time on the serving host, or worse, load garbage)."""
    from ...model.streamed_model import meta_model

    model, rules = meta_model(model_dir, set(src.names()))
    for param, value in model.named_parameters(remove_duplicate=False):
        _check_shape(param, tuple(value.shape), rules[param], src)
    used = {s for rule in rules.values() for s in rule.sources}
    return CheckpointMap(model, rules, sorted(n for n in src.names() if n not in used))


def _check_shape(param: str, expected: tuple[int, ...], rule: WeightRule, src: TensorSource) -> None:
    """The parameter the rule makes from the stored shapes (on the meta device) has the config's shape."""
    import torch

    stored = {s: tuple(src.info(s).shape) for s in rule.sources}
    if rule.combine is None:
        got = stored[rule.sources[0]]
    elif getattr(rule.combine, "mxfp4", False):
        return  # MXFP4 dequantization indexes a table (no meta tensors): checked when the reference loads it
    else:
        try:
            got = tuple(rule.load(lambda s: torch.empty(stored[s], device="meta")).shape)
        except RuntimeError:  # stacked experts of different shapes
            shapes = sorted({str(list(v)) for v in stored.values()})
            raise ModelFormatError(f"weights do not match config.json: {param} is made from {len(stored)} stored "
                                   f"tensors of different shapes ({', '.join(shapes[:3])})") from None
    if got != expected:
        shown = rule.sources[0] if len(rule.sources) == 1 else f"{param} (from {len(rule.sources)} stored tensors)"
        raise ModelFormatError(f"weights do not match config.json: {shown} has shape {list(got)}, "
                               f"the config implies {list(expected)}")
