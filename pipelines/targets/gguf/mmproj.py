"""The vision side of a vision-language model as llama.cpp's projector GGUF (`mmproj`, arch `clip`).

llama.cpp runs a VLM from two files: the language model (`convert.py`, one of `families/`) and the vision tower
with its projector, which its converter writes with `--mmproj` and libmtmd reads. A projector is declared in
`projectors.py` in the families' vocabulary (`spec.Rule`: checkpoint tensors -> GGUF tensors through a transform;
`spec.Param`: config values -> `clip.*` keys), over the vision config. This module plans it from the safetensors
headers (every tensor of the vision side mapped or deliberately ignored) and streams it as the language model is
streamed (`convert._write_step`: row slices, NaN/Inf refused, no partial file left behind).

A projector is written in F16 with the type rules of llama.cpp's converter (vectors, norms, biases and position
embeddings in F32; each projector's own forced types), whatever the language model's file type: llama.cpp's
converter writes projectors in F16 or F32 only, and its published GGUFs pair every quantization with the F16
projector. The file is named as llama.cpp's converter names it, `mmproj-<model>-F16.gguf`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ...core.errors import ModelFormatError
from ...core.progress import bar
from ...source.safetensors_io import TensorSource
from .convert import Output, Step, _write_step, text_config
from .families.spec import HParams, Param, Rule, accept, derived, located, param
from .kv_writer import add_key_value, general_metadata

Q = gguf.GGMLQuantizationType
C, V = gguf.Keys.Clip, gguf.Keys.ClipVision
# Forced types every projector shares (llama.cpp's MmprojModel): the patch embedding's convolution in F16.
BASE_TYPES = ((r"v\.patch_embd\.weight(\.1)?", Q.F16),)


def mmproj_name(model_id: str) -> str:
    return f"mmproj-{model_id.split('/')[-1]}-F16.gguf"


def preprocessor(model_dir: Path) -> dict[str, Any]:
    """The image processor's settings as llama.cpp's converter reads them: preprocessor_config.json, then
    processor_config.json's `image_processor` over it."""
    out: dict[str, Any] = {}
    for fname, nested in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        if (model_dir / fname).is_file():
            doc = json.loads((model_dir / fname).read_text())
            out.update({**doc, **(doc.get(nested) or {})} if nested else doc)
    return out


def hparams(cfg: dict[str, Any], model_dir: Path) -> HParams:
    """The projector's HParams: the vision config, with the outer config, the text config and the image
    processor's settings beside it (`_outer`, `_text`, `_pre`)."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        raise ModelFormatError("config.json has no vision_config: no vision projector to write")
    return HParams({**vision, "_outer": cfg, "_text": text_config(cfg), "_pre": preprocessor(model_dir)})


def text_hidden(hp: HParams) -> int:
    return int(hp.get("_text").get("hidden_size") or hp.get("_text").get("n_embd"))


def image_stat(which: str, default: list[float] | None = None):
    def value(hp: HParams) -> list[float]:
        stat = hp.get("_pre").get(which, default)
        if stat is None:
            raise ModelFormatError(f"the image processor config has no {which} (preprocessor_config.json)")
        return [float(x) for x in (stat if isinstance(stat, list) else [stat] * 3)]
    return value


# The keys llama.cpp's converter writes for every vision projector (MmprojModel); a projector's own params replace
# these by key (a value of None drops one). `blocks` is the projector's count of vision blocks written.
COMMON = (
    derived(C.HAS_VISION_ENCODER, lambda hp: True, kind=bool),
    derived(V.PROJECTION_DIM, text_hidden),
    param(V.IMAGE_SIZE, "image_size", required=True),
    param(V.PATCH_SIZE, "patch_size", required=True),
    param(V.EMBEDDING_LENGTH, "hidden_size", "width", required=True),
    param(V.FEED_FORWARD_LENGTH, "intermediate_size", required=True),
    derived(V.BLOCK_COUNT, lambda hp: hp.get("_blocks")),
    param(V.Attention.HEAD_COUNT, "num_attention_heads", "num_heads", required=True),
    derived(V.IMAGE_MEAN, image_stat("image_mean"), kind=list),
    derived(V.IMAGE_STD, image_stat("image_std"), kind=list),
)


@dataclass(frozen=True)
class Projector:
    """One llama.cpp projector type and the HF vision-language architectures written as it. Rule names are the
    released checkpoint's (`{bid}`: a vision block; `{level}`: the DeepStack level of that block)."""

    name: str
    architectures: tuple[str, ...]
    tensors: tuple[Rule, ...]
    params: tuple[Param, ...]
    vision: tuple[str, ...]  # checkpoint prefixes of the vision side (every tensor under them mapped or ignored)
    renames: tuple[tuple[str, str], ...] = ()  # (prefix as released, prefix elsewhere), tried in order
    blocks: Callable[[HParams], int] = lambda hp: hp.n_layers  # vision blocks written (and counted in block_count)
    levels: Callable[[HParams], list[int]] = lambda hp: []  # blocks feeding a DeepStack level, in level order
    types: tuple[tuple[str, Q], ...] = ()  # (GGUF name regex, type) forced, as llama.cpp's converter forces them
    ignored: tuple[str, ...] = ()  # regexes of vision-side tensors deliberately unused
    # regex of a vision block's tensors, its group the block: blocks past `blocks` are unused (layers after the
    # one whose output feeds the projector)
    deeper: str | None = None
    check: Callable[[HParams], None] = accept
    # validation (mmproj_check.py): the side of a square test image llama.cpp's preprocessing leaves at its size;
    # `patches`: transformers takes it as Qwen-VL's flattened (time x patch) rows with their grid
    probe: Callable[[HParams], int] = lambda hp: int(hp.require("image_size"))
    patches: bool = False
    divergence: str | None = None  # why llama.cpp's graph cannot match transformers (then not gated)

    def located(self, name: str, present: Callable[[str], bool]) -> str:
        return located(name, self.renames, present)

    def key_values(self, hp: HParams) -> dict[str, tuple[Any, type]]:
        out: dict[str, tuple[Any, type]] = {}
        own = {p.key for p in self.params}  # a common key the projector sets is not read the common way
        for p in tuple(c for c in COMMON if c.key not in own) + self.params:
            value = p.value(hp)
            if value is not None:
                out[p.key] = (value, p.kind)
        return out

    def tensor_type(self, name: str, shape: tuple[int, ...]) -> Q:
        """llama.cpp's converter's choice at F16: vectors and norms F32; then a forced type; then position
        embeddings and anything not a `.weight` F32; every other matrix F16."""
        if len(shape) <= 1 or name.endswith("_norm.weight"):
            return Q.F32
        forced = next((q for pattern, q in self.types + BASE_TYPES if re.fullmatch(pattern, name)), None)
        if forced is not None:
            return forced
        return Q.F32 if name == "v.position_embd.weight" or not name.endswith(".weight") else Q.F16


def projector_hparams(projector: Projector, cfg: dict[str, Any], model_dir: Path) -> HParams:
    """The HParams a projector's rules and keys read, checked (one-line refusals) and with its block count."""
    hp = hparams(cfg, model_dir)
    projector.check(hp)
    return HParams({**hp.cfg, "_blocks": int(projector.blocks(hp))})


def plan(projector: Projector, hp: HParams, tensors: TensorSource) -> list[Step]:
    """Every GGUF tensor of the projector from the headers; every vision-side tensor mapped or ignored."""
    steps: list[Step] = []
    used: set[str] = set()
    levels = list(projector.levels(hp))

    def take(rule: Rule, bid: int | None) -> None:
        if rule.when is not None and bid is not None and not rule.when(hp, bid):
            return

        def fill(n: str) -> str:
            if bid is None:
                return n
            return n.replace("{bid}", str(bid)).replace("{level}", str(levels.index(bid)) if bid in levels else "-")

        inputs = [projector.located(fill(n), tensors.__contains__) for n in rule.inputs]
        outputs = [fill(o) for o in rule.outputs]
        missing = [n for n in inputs if n not in tensors]
        if missing:
            if rule.optional and len(missing) == len(inputs):
                return
            raise ModelFormatError(f"missing tensor {missing[0]!r} for the {projector.name} projector "
                                   f"(needed for {outputs[0]})")
        used.update(inputs)
        try:
            shapes = rule.transform.shapes([tuple(tensors.info(n).shape) for n in inputs], hp)
        except ModelFormatError as e:
            raise ModelFormatError(f"{inputs[0]}: {e}") from None
        steps.append(Step(rule, inputs, [Output(n, s, projector.tensor_type(n, s)) for n, s in zip(outputs, shapes)],
                          source_bytes=sum(tensors.info(n).nbytes for n in inputs)))

    for rule in projector.tensors:
        if not rule.per_block:
            take(rule, None)
    for bid in range(int(hp.get("_blocks"))):
        for rule in projector.tensors:
            if rule.per_block:
                take(rule, bid)
    vision = tuple(projector.vision) + tuple(moved for _, moved in projector.renames)
    def unused(n: str) -> bool:
        deep = re.fullmatch(projector.deeper, n) if projector.deeper else None
        return any(re.fullmatch(p, n) for p in projector.ignored) or bool(deep and int(deep[1]) >= hp.get("_blocks"))

    leftover = sorted(n for n in tensors if n.startswith(vision) and n not in used and not unused(n))
    if leftover:
        more = f" and {len(leftover) - 3} more" if len(leftover) > 3 else ""
        raise ModelFormatError(f"unmapped tensors for the {projector.name} projector: {', '.join(leftover[:3])}{more}")
    return steps


def convert_mmproj(projector: Projector, model_dir: Path, cfg: dict[str, Any], safetensors: list[Path],
                   out_path: Path, *, name: str, provenance: dict[str, str] | None = None) -> dict[str, Any]:
    """The projector of `model_dir` -> one F16 GGUF at `out_path` (arch `clip`, general.type `mmproj`); returns
    what the manifest records of it."""
    hp = projector_hparams(projector, cfg, model_dir)
    key_values = projector.key_values(hp)
    with TensorSource(safetensors) as tensors:
        steps = plan(projector, hp, tensors)
        outputs = [o for step in steps for o in step.outputs]
        writer = gguf.GGUFWriter(str(out_path), "clip")
        started = False
        try:
            for o in outputs:
                itemsize = 4 if o.qtype == Q.F32 else 2
                writer.add_tensor_info(o.name, o.shape, np.dtype(np.float32 if itemsize == 4 else np.float16),
                                       int(np.prod(o.shape)) * itemsize)
            general = general_metadata(writer, model_dir, name)
            # the model's general.* keys as for the language model, but the file is a projector
            writer.kv_data[0][gguf.Keys.General.TYPE] = gguf.GGUFValue(gguf.GGUFType.MMPROJ, gguf.GGUFValueType.STRING)
            writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
            for key, (value, kind) in key_values.items():
                add_key_value(writer, key, value, kind)
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for key, value in sorted((provenance or {}).items()):
                writer.add_string(f"hive_aot.{key}", value)
            started = True
            writer.write_header_to_file(path=out_path)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            with bar(sum(s.source_bytes for s in steps), "gguf mmproj") as pb:
                for step in steps:
                    _write_step(step, tensors, hp, writer, name, pb)
        except BaseException:
            writer.close()
            if started:
                out_path.unlink(missing_ok=True)
            raise
        writer.close()
        types: dict[str, int] = {}
        for o in outputs:
            types[o.qtype.name] = types.get(o.qtype.name, 0) + 1
        return {"file": out_path.name, "projector": projector.name,
                "projector_type": key_values.get(C.PROJECTOR_TYPE, (None,))[0], "tensors": len(outputs),
                "tensor_types": types, "parameters": sum(int(np.prod(o.shape)) for o in outputs),
                "vision_blocks": int(hp.get("_blocks")), "name": general.get("name")}
