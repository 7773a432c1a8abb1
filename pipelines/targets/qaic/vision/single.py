"""QEfficient's single-QPC form of a vision-language model (`kv_offload=False`, reference/ai100-qpc.md "VLMs"):
one graph takes the image (`pixel_values`, the family's vision inputs) beside the text inputs, runs the vision
tower and the language decoder in one program, and keeps the image as device state (`pixel_values_RetainedState`)
so decode steps need not send it again. One device program, one sequence at a time (vllm-qaic runs a single QPC
with max_num_seqs 1; continuous batching is dual-only).

The graph is composed from the export's two graphs at bundle time, not exported again: the vision graph's nodes
and initializers under a `vision/` prefix, its `vision_embeds` fed straight into the language graph's input of that
name (and any other image state, DeepStack's), the language graph's retained twins of them replaced by the
image inputs' retained twins. Weights are
not loaded: the composed graph's initializers point into the export's two data files (`onnx/model.onnx.data`,
`onnx/vision/model.onnx.data`), so it costs a few hundred KB whatever the model's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..layout import ONNX_DIR, RETAINED
from .compile import SINGLE_ONNX, image_inputs, vision_outputs

PREFIX = "vision/"


def compose(root: Path, vision: dict[str, Any]):
    """The single graph (an onnx ModelProto, external data by reference) of the export in `root`."""
    import onnx
    from onnx import compose as onnx_compose, helper

    language = onnx.load(str(Path(root) / ONNX_DIR / "model.onnx"), load_external_data=False)
    tower = onnx.load(str(Path(root) / vision["path"]), load_external_data=False)
    tower = onnx_compose.add_prefix(tower, PREFIX, rename_inputs=False)
    # the tower's data file, named relative to the composed graph's directory (onnx/)
    data_dir = Path(vision["path"]).parent.relative_to(ONNX_DIR).as_posix()
    for init in tower.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = f"{data_dir}/{entry.value}"
    lang = language.graph
    bridged = vision_outputs(vision)  # vision_embeds (and DeepStack features): computed each call now
    lang_inputs = [i for i in lang.input if i.name not in bridged]
    retained = {f"{name}{RETAINED}" for name in bridged}
    outputs = [o for o in lang.output if o.name not in retained]
    # the image itself is the device state instead, after logits (QEfficient's single-QPC output order)
    outputs[1:1] = [helper.make_tensor_value_info(f"{i.name}{RETAINED}", i.type.tensor_type.elem_type,
                                                  [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
                    for name in image_inputs(vision) for i in tower.graph.input if i.name == name]
    keep = [n for n in lang.node if not set(n.output) & retained]
    if len(keep) != len(lang.node) - len(retained):
        from ....core.errors import ModelFormatError

        raise ModelFormatError("the language graph's image state outputs are not Identities of its inputs: "
                               "cannot compose the single QPC graph")
    bridge = [helper.make_node("Identity", [f"{PREFIX}{name}"], [name], name=f"{name}_in") for name in bridged]
    bridge += [helper.make_node("Identity", [name], [f"{name}{RETAINED}"], name=f"{name}_retain")
               for name in image_inputs(vision)]
    graph = helper.make_graph(
        list(tower.graph.node) + bridge + keep, "hive-aot-vlm-single",
        [lang_inputs[0], *tower.graph.input, *lang_inputs[1:]], outputs,
        initializer=list(tower.graph.initializer) + list(lang.initializer),
        value_info=list(tower.graph.value_info) + list(lang.value_info))
    model = helper.make_model(graph, opset_imports=list(language.opset_import),
                              producer_name="hive-aot", ir_version=max(language.ir_version, tower.ir_version))
    return model


def write_single(root: Path, vision: dict[str, Any], out_root: Path) -> str:
    """Compose the export in `root` into `out_root/SINGLE_ONNX` (the data files are the export's, found beside
    it); the relative path written."""
    import onnx

    out = Path(out_root) / SINGLE_ONNX
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    onnx.save_model(compose(root, vision), str(tmp))
    tmp.replace(out)
    return SINGLE_ONNX


def run_single(onnx_path: Path, inputs: dict[str, np.ndarray], prompt: list[int], decode_steps: int,
               ctx_len: int, positions: np.ndarray | None = None) -> dict[str, Any]:
    """Prefill with the image, then greedy decode steps feeding every retained output back (the image too).
    `positions`: the prompt's position_ids (default [1, seq] arange), continued as parity.run_language does."""
    from ..ort import _empty_state, _extra, session
    from .runs import next_positions

    sess = session(onnx_path)
    state = _empty_state(sess, 1, ctx_len)
    extra = _extra(sess)
    outputs = [o.name for o in sess.get_outputs()]
    image = {**inputs, "image_idx": np.zeros((1, 1), dtype=np.int64)}
    ids = np.asarray([prompt], dtype=np.int64)
    pos = np.arange(len(prompt), dtype=np.int64)[None] if positions is None else positions.astype(np.int64)
    logits_steps, tokens = [], []
    for _ in range(decode_steps + 1):
        res = dict(zip(outputs, sess.run(outputs, {"input_ids": ids, "position_ids": pos, **image, **state, **extra})))
        logits_steps.append(res["logits"][0, 0])
        tokens.append(int(logits_steps[-1].argmax()))
        state = {name: res[f"{name}{RETAINED}"] for name in state}
        image = {**{k: res.get(f"{k}{RETAINED}", v) for k, v in inputs.items()}, "image_idx": res["image_idx_output"]}
        ids = np.asarray([[tokens[-1]]], dtype=np.int64)
        pos = next_positions(pos)
    return {"logits": logits_steps, "tokens": tokens}
