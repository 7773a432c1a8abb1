"""A vision-language model as QEfficient's dual QPC exports it (reference/ai100-qpc.md, VLMs): the vision
graph (`onnx/vision/model.onnx`: the family's vision tower + projector, fp32 weights in one external data file)
and the language graph (`onnx/model.onnx`: the retained-state decoder of the language model, with
`vision_embeds` / `image_idx` inputs and their retained twins; matrices stored as `weight_dtype`, as every
decoder export). The language graph is where a compile's serving shape applies; the vision graph compiles to
its own QPC (one `Vision` specialization, no retained state, never MXFP6).

Memory: the model is loaded whole, in fp32 (transformers' classes, no remote code): `plan` states that up front
(`vlm_resident_bytes`), and a host whose budget is smaller is refused before any work.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ....core.errors import ModelFormatError
from ..layout import ONNX_DIR
from .spec import VisionFamily

VISION_DIR = f"{ONNX_DIR}/vision"  # the vision graph beside the language graph of ONNX_DIR/model.onnx
DATA_SUFFIX = ".data"
OPSET = 17


@dataclass
class VisionReport:
    """What the vision graph is, for the bundle and the compile (recorded in export.json under `vision`)."""

    architecture: str
    path: str  # relative to the export's root
    files: list[str]  # relative to the export's root
    inputs: list[str]
    float_inputs: list[str]  # the image tensors (compiled as float16 IO); the others are integer grids or ids
    vision_size: int  # image rows per image (the language graph's vision_size symbol)
    hidden: int
    image_token_id: int
    symbols: dict[str, str] = field(default_factory=dict)  # the Vision specialization
    single_qpc: bool = True  # the family also compiles as one QPC (kv_offload: false)
    # the graph's outputs (vision_embeds and DeepStack's features, or a cross layer's image K/V): language inputs
    outputs: list[str] = field(default_factory=lambda: ["vision_embeds"])
    language_symbols: dict[str, str] = field(default_factory=dict)  # what the language graph's specializations add
    language_float16_io: list[str] = field(default_factory=list)  # the language graph's image IO kept float16

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_vlm(model_dir: Path):
    """transformers' model of the checkpoint in fp32 with eager attention; never remote code."""
    import torch
    from transformers import AutoModelForImageTextToText

    from ....core.quiet import quiet_transformers

    quiet_transformers()
    try:
        return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager",
                                                           trust_remote_code=False).eval()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(f"transformers cannot load the vision-language model in {model_dir}: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def language_shim(family: VisionFamily, model):
    """The VLM's language model as the decoder families read a causal LM (config, decoder stack under the
    family's base name, lm_head): a module holding the VLM's own submodules, nothing copied."""
    import torch

    from ..families import family_for

    config, stack, head = family.language_model(model)
    _arch, fam = family_for(config)
    shim = torch.nn.Module()
    shim.config = config
    setattr(shim, fam.base, stack)
    shim.lm_head = head
    return shim


def language_decoder(family: VisionFamily, model, *, batch_index: bool, ctx_len: int | None = None, kv_transform=None):
    """The retained-state decoder (decoder.py) over the VLM's language model, merging image rows."""
    from ..decoder import build_decoder

    return build_decoder(language_shim(family, model), batch_index=batch_index, ctx_len=ctx_len,
                         kv_transform=kv_transform, **family.form.decoder_options(family, model.config))


def round_language(family: VisionFamily, model, weight_dtype: str) -> None:
    """Round the language graph's matrices to what the export stores (fp16, clipped to its range), in place: the
    export and the reference then read the same values (the vision graph keeps fp32, the language modules it
    reads itself included)."""
    import torch

    from ..external_data import FP16_MAX, stored_dtype

    stored_in_language = language_module_ids(family, model) - vision_side_ids(family, model)
    with torch.no_grad():
        for module in model.modules():
            if id(module) not in stored_in_language:
                continue
            for p in module.parameters(recurse=False):
                if stored_dtype(p.dim(), weight_dtype) == "float16":
                    p.copy_(p.clamp(-FP16_MAX, FP16_MAX).half().float())


def export_vision(family: VisionFamily, model, root: Path) -> VisionReport:
    """Trace the family's vision module to `root/onnx/vision/model.onnx` (+ .data): its outputs are the
    form's (vision_embeds, or the cross layers' K/V)."""
    import onnx
    import torch

    module = family.vision_module(model)
    sample = family.vision_inputs(model.config, 0)
    names = list(sample)
    axes = {name: family.vision_axes.get(name, {}) for name in names}
    shapes = family.form.vision_outputs(family, model.config)  # name -> (its image axis, the other dims)
    for name, (image_axis, _dims) in shapes.items():
        axes[name] = {image_axis: "batch_size"}
    out = Path(root) / VISION_DIR / "model.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".trace")
    with torch.no_grad(), warnings.catch_warnings():
        # the vision towers' shape checks become constants of the trace: right for the one compiled image size
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        got = module(*(torch.from_numpy(a) for a in sample.values()))
        got = got if isinstance(got, tuple) else (got,)
        torch.onnx.export(module, tuple(torch.from_numpy(a) for a in sample.values()), str(tmp), input_names=names,
                          output_names=list(shapes), dynamic_axes={k: v for k, v in axes.items() if v},
                          opset_version=OPSET, do_constant_folding=True, dynamo=False)
    graph = onnx.load(str(tmp))
    tmp.unlink()
    data = out.name + DATA_SUFFIX
    out.with_name(data).unlink(missing_ok=True)
    graph.producer_name = "hive-aot"
    onnx.save_model(graph, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=0)
    size = family.vision_size(model.config)
    given = [tuple(d for i, d in enumerate(t.shape) if i != axis) for t, (axis, _dims) in zip(got, shapes.values())]
    wanted = [dims for _axis, dims in shapes.values()]
    if len(got) != len(shapes) or given != wanted:
        raise ModelFormatError(f"the vision module gives {given}, not {wanted} besides the image axis: the "
                               "family's declaration does not match this checkpoint")
    return VisionReport(architecture=model.config.architectures[0], path=f"{VISION_DIR}/model.onnx",
                        files=[f"{VISION_DIR}/model.onnx", f"{VISION_DIR}/{data}"], inputs=names,
                        float_inputs=[n for n, a in sample.items() if a.dtype.kind == "f"], vision_size=size,
                        hidden=int(model.config.get_text_config().hidden_size),
                        image_token_id=family.image_token_id(model.config), symbols=family.vision_symbols(model.config),
                        single_qpc=family.single_qpc, outputs=list(shapes),
                        **family.form.compile_record(family, model.config))


def language_module_ids(family: VisionFamily, model) -> set[int]:
    """The ids of every module of the VLM's language model (decoder stack and lm_head): what is not among them
    (the vision tower, the projector, learned image rows) is the vision side."""
    _config, stack, head = family.language_model(model)
    return {id(m) for part in (stack, head) for m in part.modules()}


def vision_side_ids(family: VisionFamily, model) -> set[int]:
    """The ids of the modules the vision graph reads: everything outside the language model, and the language
    modules the family's form runs in the vision graph (Mllama's cross layers' K/V projections)."""
    language = language_module_ids(family, model)
    outside = {id(m) for m in model.modules() if id(m) not in language}
    return outside | {id(m) for part in family.form.language_modules_in_vision(model) for m in part.modules()}


def load_vision_weights(family: VisionFamily, model, rules, source) -> int:
    """Read the vision side's parameters of a placeholder VLM from the checkpoint (fp32; the rest of the language
    model stays placeholders, streamed later): returns how many."""
    import torch

    from ....model.streamed_model import read_float32

    vision = vision_side_ids(family, model)
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    loaded = 0
    for module in model.modules():
        if id(module) not in vision:
            continue
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            name = names[id(param)]
            value = rules[name].load(lambda tensor: read_float32(source, tensor))
            if not torch.isfinite(value).all():  # the language side is checked as it streams into the data file
                raise ModelFormatError(f"tensor for {name} holds NaN/Inf values: refusing to convert a broken model")
            module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
            loaded += 1
    return loaded


def export_vlm(family: VisionFamily, model_dir: Path, root: Path, *, batch_index: bool = True,
               weight_dtype: str = "float16", ctx_len: int = 128):
    """Both graphs of the VLM checkpoint in `model_dir`, without the model in memory: the VLM is built over
    placeholders (export.placeholder_model), only its vision side read for real (the vision graph is traced with
    its weights); the language graph is traced over placeholders and its weights stream from the safetensors into
    its data file, as a decoder's do. Memory: the vision side in fp32, the graph and a few chunks.
    (the language graph's ExportReport, the VisionReport)."""
    from ..export import export_placeholder_decoder, placeholder_model

    model, rules, source = placeholder_model(Path(model_dir))
    try:
        load_vision_weights(family, model, rules, source)
        vision = export_vision(family, model, root)
        decoder = language_decoder(family, model, batch_index=batch_index, ctx_len=ctx_len)
        report = export_placeholder_decoder(decoder, model, rules, source, Path(root) / ONNX_DIR / "model.onnx",
                                            ctx_len=ctx_len, weight_dtype=weight_dtype)
    finally:
        source.close()
    return report, vision
