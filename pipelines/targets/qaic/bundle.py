"""The export bundle of a compile recipe: the input export's files (ONNX with external data, config,
tokenizer: linked, digests carried over) plus the compile inputs for this serving shape and the exact
command (compile.py). Everything a host with the Apps SDK needs to produce the QPC, and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...core.errors import NotApplicableError
from ...core.paths import link_or_copy
from .. import BuildContext, BuiltArtifact
from .compile import COMPILE_DIR, CompileOptions, command, compile_files, vision_command
from .layout import BUNDLE_FORMAT, EXPORT_REPORT, KEEP_INPUT, RETAINED
from .vision.compile import form_problem, language_onnx

COMMAND_FILE = f"{COMPILE_DIR}/command.json"


def command_doc(opts: CompileOptions, onnx_rel: str, sdk_version: str, compiler: str | None = None,
                vision: dict[str, Any] | None = None) -> dict[str, Any]:
    """The recorded command(s): `argv`, and a VLM's `vision_argv` (its vision QPC, compiled beside)."""
    argv = command(opts, onnx_rel, sdk_version, compiler)
    doc = {"argv": argv, "sdk_version": sdk_version,
           "placeholders": {"{bundle}": "the bundle (or artifact) directory", "{qpc}": "the QPC output directory"}}
    if vision is not None and opts.kv_offload:
        doc["vision_argv"] = vision_command(opts, vision, sdk_version, compiler)
        doc["placeholders"]["{qpc_vision}"] = "the vision QPC's output directory, beside {qpc}"
    return doc


def write_bundle(ctx: BuildContext, out_dir: Path) -> BuiltArtifact:
    opts = CompileOptions.parse(ctx.recipe.options)
    inp = ctx.input
    assert inp is not None
    known = {f.path: f.sha256 for f in inp.manifest.files}
    files = []
    for rel in known:  # the input's files as placed from the store's blobs (0644): linked, not copied
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(inp.root / rel, out_dir / rel)
        files.append(rel)
    export_info = json.loads((inp.root / EXPORT_REPORT).read_text())
    vision = export_info.get("vision")
    problem = form_problem(vision, opts)
    if problem:
        raise NotApplicableError(f"recipe {ctx.recipe.id}: {problem}")
    onnx_rel = language_onnx(vision, opts)
    if onnx_rel not in known:  # the single QPC's graph, composed from the export's two (vision/single.py)
        from .vision.single import write_single

        files.append(write_single(out_dir, vision, out_dir))
    for rel, body in compile_files(int(export_info["layers"]), opts, vision=vision).items():
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / rel).write_bytes(body)
        files.append(rel)
    doc = command_doc(opts, onnx_rel, opts.sdk_version, vision=vision)
    (out_dir / COMMAND_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    files.append(COMMAND_FILE)
    # `needs`: what pull and status name when they say where the pending compile can run
    info = {"state": "compile_pending", "format": BUNDLE_FORMAT, "needs": "the Cloud AI SDK",
            "input": {"recipe": inp.recipe, "build_id": inp.build_id},
            "compile": {"command": doc["argv"], "sdk_version": opts.sdk_version, "options": opts.recorded(),
                        **({"vision_command": doc["vision_argv"]} if "vision_argv" in doc else {})}}
    return BuiltArtifact(root=out_dir, files=files, info=info, known_digests=known, format=BUNDLE_FORMAT)


def check_bundle(root: Path, files: dict[str, str], opts: CompileOptions) -> list[str]:
    """The compile inputs agree with the ONNX they are for: every past input and retained output is in
    custom_io.yaml at the KV precision, and the ONNX's dynamic axes are the specialization symbols."""
    import onnx

    vision = json.loads((root / EXPORT_REPORT).read_text()).get("vision") if (root / EXPORT_REPORT).is_file() else None
    onnx_rel = language_onnx(vision, opts)
    if onnx_rel not in files:
        return [f"the bundle has no {onnx_rel}"]
    graph = onnx.load(str(root / onnx_rel), load_external_data=False).graph
    # the retained state custom_io.yaml must cover (the KV cache, a VLM's image rows); it may also name other IO
    io_names = [v.name for v in list(graph.input) + list(graph.output) if v.name.startswith(("past_", "vision_embeds"))]
    if opts.retained_state and not io_names:
        return ["the ONNX has no retained-state KV cache (an encoder): compile it with task: embedding"]
    if not opts.retained_state:
        if io_names:
            return ["task: embedding, but the ONNX has a retained-state KV cache (a decoder): use task: generate"]
        return _check_symbols(root, graph)  # an encoder: no KV tensors, no custom_io.yaml
    text = (root / COMPILE_DIR / "custom_io.yaml").read_text()
    listed = {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("- IOName:")}
    problems = []
    missing = sorted(set(io_names) - listed)
    if missing:
        problems.append(f"custom_io.yaml misses {len(missing)} KV tensors of the ONNX (first: {missing[0]})")
    extra = sorted(listed - {v.name for v in list(graph.input) + list(graph.output)})
    if extra:
        problems.append(f"custom_io.yaml names tensors the ONNX does not have (first: {extra[0]})")
    problems += _check_symbols(root, graph)
    problems += _check_vision(root, files, graph, vision) if opts.kv_offload else _check_single(graph, vision)
    inputs = [i.name for i in graph.input]
    if opts.full_batch_size and "batch_index" not in inputs:
        problems.append("full_batch_size is set but the ONNX has no batch_index input (export with batch_index: true)")
    if bool(opts.num_speculative_tokens) != (KEEP_INPUT in inputs):
        problems.append(f"num_speculative_tokens is {'set' if opts.num_speculative_tokens else 'not set'} but the ONNX "
                        f"{'has no' if opts.num_speculative_tokens else 'has a'} {KEEP_INPUT} input (the target LM's: "
                        "export with target_lm: true for speculative decoding, without it otherwise)")
    return problems


def _check_single(graph, vision: dict[str, Any] | None) -> list[str]:
    """The single QPC's graph takes the image itself and keeps it as device state, not the image rows."""
    from .vision.compile import image_inputs

    names = {v.name for v in list(graph.input) + list(graph.output)}
    wanted = {n for name in image_inputs(vision or {"float_inputs": []}) for n in (name, f"{name}{RETAINED}")}
    if vision is None or not wanted or not wanted <= names or "vision_embeds" in names:
        return ["kv_offload: false, but the compiled graph is not a single VLM graph (image inputs and their "
                "retained twins, no vision_embeds)"]
    return []


def _check_vision(root: Path, files: dict[str, str], graph, vision: dict[str, Any] | None) -> list[str]:
    """A VLM's language graph comes with its vision graph and that graph's compile inputs, and not otherwise."""
    from .vision.compile import IMAGE_INPUTS, VISION_COMPILE_DIR, vision_outputs

    takes_image = any(i.name in IMAGE_INPUTS for i in graph.input)
    if not takes_image:
        return [f"export.json records a vision graph, but the language ONNX takes none of {', '.join(IMAGE_INPUTS)}"
                ] if vision else []
    if vision is None or vision["path"] not in files:
        return ["the language ONNX takes an image, but the bundle has no vision graph (export.json: vision)"]
    import onnx

    vision_graph = onnx.load(str(root / vision["path"]), load_external_data=False).graph
    state = vision_outputs(vision)  # vision_embeds (and e.g. deepstack_features), or a cross layer's image K/V
    if [o.name for o in vision_graph.output] != state:
        return [f"{vision['path']} does not output {', '.join(state)} (export.json: vision)"]
    missing = sorted(set(state) - {i.name for i in graph.input})
    if missing:
        return [f"the language ONNX does not take {', '.join(missing)}, which the vision graph outputs"]
    return _check_symbols(root, vision_graph, VISION_COMPILE_DIR)


def _check_symbols(root: Path, graph, compile_dir: str = COMPILE_DIR) -> list[str]:
    """Every symbol a specialization sets is a dynamic axis of the ONNX."""
    symbols = {d.dim_param for v in list(graph.input) + list(graph.output)
               for d in v.type.tensor_type.shape.dim if d.dim_param}
    specs = json.loads((root / compile_dir / "specializations.json").read_text())["specializations"]
    for spec in specs:
        unknown = set(spec.get("symbols", spec)) - {"name"} - symbols
        if unknown:
            return [f"specializations.json sets {', '.join(sorted(unknown))}, which the ONNX does not have as "
                    f"dynamic axes ({', '.join(sorted(symbols))})"]
    return []
