"""The compile contract of a vision-language bundle's second program, as data (plain Python, read on the
compile host without torch): QEfficient's dual QPC (reference/ai100-qpc.md, VLMs).

- the vision QPC: `onnx/vision/model.onnx` with one `Vision` specialization (the family's symbols, recorded in
  export.json), no `-retained-state`, never `-mxfp6-matmul`, its image inputs and `vision_embeds` in the model's
  compute dtype (float16 after `-convert-to-fp16`) through `compile/vision/custom_io.yaml`; one device (the
  language QPC is the one tensor slicing splits), written to `qpc-vision/`;
- the language QPC: the usual decoder compile, its Prefill and Decode specializations also fixing what the
  family's form records in export.json (`language_symbols`: merged rows fix `vision_batch_size` (1) and
  `vision_size` (the image rows); cross-attention K/V fix `max_num_images`), and the image's IO kept in float16
  whatever the KV precision (`language_float16_io`: `vision_embeds` (and Qwen3-VL's `deepstack_features`) with
  their retained twins, or the cross layers' K/V, which the vision QPC writes in float16).
Records written before the form existed (LLaVA) carry neither field: the merged-rows values are their default.
The single-QPC form (kv_offload: false, single.py) compiles one graph instead: the image inputs are its state.
vllm-qaic loads a prebuilt dual QPC from one path naming both, `<vision_qpc>:<language_qpc>` (serving.py).
"""

from __future__ import annotations

import json
from typing import Any

from ..layout import ONNX_DIR, RETAINED

VISION_COMPILE_DIR = "compile/vision"
VISION_QPC_DIR = "qpc-vision"  # beside the language QPC's qpc/
QPC_VISION = "{qpc_vision}"  # the placeholder of the vision QPC's output directory in a recorded command
SINGLE_ONNX = f"{ONNX_DIR}/model-single.onnx"  # the single QPC's graph (single.py), beside the language graph
IMAGE_INPUTS = ("vision_embeds", "cross_attention_mask")  # inputs only a VLM's language graph has (either form)


def vision_outputs(vision: dict[str, Any]) -> list[str]:
    """The vision graph's outputs (export.json): vision_embeds (and DeepStack's features), or a cross-attention
    family's K/V per cross layer; `vision_embeds` in a record that predates the field."""
    return list(vision.get("outputs") or ["vision_embeds"])


def image_inputs(vision: dict[str, Any]) -> list[str]:
    """The single graph's image inputs kept as device state (the float ones: grids and ids are shapes)."""
    return list(vision["float_inputs"])


def language_symbols(vision: dict[str, Any], opts) -> dict[str, str]:
    """What the language graph's Prefill and Decode specializations add: the form's record (merged rows: one image
    of `vision_size` rows); the single graph's image axes instead, the Vision specialization's symbols (its batch
    is the sequence's)."""
    if not opts.kv_offload:
        return {k: str(v) for k, v in vision["symbols"].items() if k != "batch_size"}
    recorded = vision.get("language_symbols")
    if recorded:
        return {k: str(v) for k, v in recorded.items()}
    return {"vision_batch_size": "1", "vision_size": str(int(vision["vision_size"]))}


def language_custom_io(vision: dict[str, Any], opts) -> list[tuple[str, str]]:
    """The image state (dual: the form's record, else the vision graph's outputs; single: the image inputs) and
    its retained twins stay in the model's dtype: QEfficient never compresses them to MXINT8."""
    if not opts.kv_offload:
        names = [n + suffix for n in image_inputs(vision) for suffix in ("", RETAINED)]
    else:
        names = vision.get("language_float16_io") or [n + s for n in vision_outputs(vision) for s in ("", RETAINED)]
    return [(name, "float16") for name in names]


def language_onnx(vision: dict[str, Any] | None, opts) -> str:
    """The graph the main program compiles: the language graph, or the single graph of a VLM without kv_offload."""
    if vision is not None and not opts.kv_offload:
        return SINGLE_ONNX
    return f"{ONNX_DIR}/model.onnx"


def form_problem(vision: dict[str, Any] | None, opts) -> str | None:
    """Why these options cannot compile this export (None: they can)."""
    if opts.kv_offload:
        return None
    if vision is None:
        return "kv_offload: false (a single QPC) is for vision-language models; this export has no vision graph"
    if not vision.get("single_qpc", False):
        return (f"{vision['architecture']} compiles as a dual QPC only in hive-aot (QEfficient has no single-QPC "
                "form of it, or hive-aot does not compose one yet): drop kv_offload: false")
    return None


def vision_specializations(vision: dict[str, Any], named: bool) -> dict[str, Any]:
    symbols = {k: str(v) for k, v in vision["symbols"].items()}
    return {"specializations": [{"name": "Vision", "symbols": symbols} if named else symbols]}


def vision_custom_io(vision: dict[str, Any]) -> str:
    lines = []
    for name in list(vision["float_inputs"]) + vision_outputs(vision):  # integer inputs (grids, ids) keep their type
        lines += [f"- IOName: {name}", "  Precision: float16", ""]
    return "\n".join(lines)


def vision_files(vision: dict[str, Any], named: bool) -> dict[str, bytes]:
    return {f"{VISION_COMPILE_DIR}/specializations.json": (json.dumps(vision_specializations(vision, named), indent=1)
                                                           + "\n").encode(),
            f"{VISION_COMPILE_DIR}/custom_io.yaml": vision_custom_io(vision).encode()}


def vision_command(opts, vision: dict[str, Any], exe: str, modern: bool, bundle: str) -> list[str]:
    """The vision QPC's compiler argv (`bundle`: compile.py's placeholder of the bundle directory; the output
    is the {qpc_vision} placeholder). `opts`: the recipe's CompileOptions (cores, hardware version)."""
    argv = [exe, "-aic-hw", f"-aic-hw-version={opts.hw_version}", f"-m={bundle}/{vision['path']}", "-convert-to-fp16"]
    if not modern:
        argv.append("-compile-only")
    argv += [f"-aic-num-cores={opts.num_cores}",
             f"-network-specialization-config={bundle}/{VISION_COMPILE_DIR}/specializations.json",
             f"-custom-IO-list-file={bundle}/{VISION_COMPILE_DIR}/custom_io.yaml", f"-aic-binary-dir={QPC_VISION}"]
    return argv
