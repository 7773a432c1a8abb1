"""AI 100 vision-language models (pipelines/targets/qaic/vision/, issue 25 item 1), QEfficient's dual QPC: a tiny
random model of each family (LLaVA-1.5, LLaVA-NeXT, InternVL) exported as a vision graph and a language graph
that merges the image rows over the placeholder tokens, run in onnxruntime on a synthetic image (numpy) against
transformers fp32 (both halves and end to end);
the compile inputs of both QPCs; and the whole path check -> export -> bundle -> STAND-IN compile -> pull."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from pipelines.targets.qaic.compile import CompileOptions, command, compile_files, fill, vision_command
from pipelines.targets.qaic.vision import VISION_FAMILIES, vision_family
from pipelines.targets.qaic.vision.export import VISION_DIR, export_vlm, load_vlm, round_language
from pipelines.targets.qaic.vision.parity import image_prompt, vlm_parity
from pipelines.targets.qaic.vision.runs import run_language, run_vision

TEXT = [1, 17, 33, 90, 5, 6, 7, 40]


def tiny_llava(model_dir: Path, vocab: int = 256, image_token: int = 255, text_layers: int = 2, **text_sizes) -> Path:
    """`text_sizes`: the language model's config beyond these (test_qaic_vision_gates.py: SmolLM2's sizes)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    text = LlamaConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=text_layers,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                 max_position_embeddings=4096, initializer_range=0.1), **text_sizes})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=56, patch_size=14, projection_dim=32)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token, vision_feature_layer=-2)
    LlavaForConditionalGeneration(cfg).save_pretrained(str(model_dir))
    return model_dir


def tiny_llava_next(model_dir: Path, vocab: int = 256, image_token: int = 255) -> Path:
    """Tiles of 28 pixels, pinpoints giving a 2x2 grid for the family's compiled image size, so the trim
    (unpad_image) and the image_newline rows both show."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(0)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, initializer_range=0.1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=28, patch_size=14, projection_dim=32)
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_token, vision_feature_layer=-1,
                          image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]])
    model = LlavaNextForConditionalGeneration(cfg)
    with torch.no_grad():  # transformers initializes image_newline to zeros-ish noise; make its rows tell
        model.model.image_newline.normal_(0, 1)
    model.save_pretrained(str(model_dir))
    return model_dir


def tiny_internvl(model_dir: Path, vocab: int = 256, image_token: int = 255) -> Path:
    """transformers' native InternVL (the -hf layout): tiles of 28 pixels, pixel shuffle 0.5, a Qwen2 decoder."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, Qwen2Config

    torch.manual_seed(0)
    text = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, initializer_range=0.1)
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=[28, 28], patch_size=[14, 14])
    cfg = InternVLConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=image_token,
                         downsample_ratio=0.5, vision_feature_layer=-1)
    InternVLForConditionalGeneration(cfg).save_pretrained(str(model_dir))
    return model_dir


TINY = {"LlavaForConditionalGeneration": tiny_llava, "LlavaNextForConditionalGeneration": tiny_llava_next,
        "InternVLForConditionalGeneration": tiny_internvl}
_EXPORTS: dict[str, tuple] = {}


def _export(tmp_path_factory, arch: str):
    """One tiny model of `arch` exported once per test session module (fp16-rounded language weights)."""
    if arch not in _EXPORTS:
        model_dir = TINY[arch](tmp_path_factory.mktemp(arch) / "model")
        _arch, family = vision_family(json.loads((model_dir / "config.json").read_text()))
        model = load_vlm(model_dir)
        round_language(family, model, "float16")
        root = tmp_path_factory.mktemp(f"{arch}-onnx")
        report, vision = export_vlm(family, model_dir, root, batch_index=True)  # streamed from the checkpoint
        _EXPORTS[arch] = (family, model, root, report, vision)
    return _EXPORTS[arch]


def assert_end_to_end(r: dict, rows: int) -> None:
    """vlm_parity's result: both halves and the whole agree with transformers, every image row consumed."""
    assert r["finite"] and r["steps"] == 9 and r["vision_rows"] == rows, r
    assert r["vision_max_abs_delta"] < 1e-4, r
    assert r["top1_agreement"] == 1.0 and r["max_abs_logit_delta"] < 1e-3, r
    assert r["tokens_equal"], r
    assert r["image_rows_consumed"] == rows  # image_idx_output: every row was read by the prefill


def language_io(root: Path) -> tuple[list[str], list[str], dict[str, list]]:
    """The language graph's inputs (initializers aside), outputs, and each input's dims."""
    lang = onnx.load(str(root / "onnx" / "model.onnx"), load_external_data=False).graph
    inits = {t.name for t in lang.initializer}
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in lang.input}
    return [i.name for i in lang.input if i.name not in inits], [o.name for o in lang.output], dims


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _export(tmp_path_factory, "LlavaForConditionalGeneration")


@pytest.mark.parametrize("case", ["LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                  "InternVLForConditionalGeneration"])
def test_both_graphs_match_transformers_end_to_end_on_a_synthetic_image(case, tmp_path_factory):
    """transformers runs the whole model on the same image (its own packing, pixel shuffle, placeholder count
    check), so a wrong vision_size or row order fails here, not only a wrong number."""
    family, model, root, _report, vision = _export(tmp_path_factory, case)
    assert vision.architecture == case
    r = vlm_parity(family, model, root / "onnx" / "model.onnx", root / vision.path, TEXT, decode_steps=8)
    assert_end_to_end(r, vision.vision_size)
    other = family.vision_inputs(model.config, 1)  # a second image changes what the model says
    prompt = image_prompt(family, model.config, TEXT)
    first = run_language(root / "onnx" / "model.onnx", run_vision(root / vision.path, family.vision_inputs(model.config, 0)),
                         prompt, 0, len(prompt) + 4)["logits"][0]
    second = run_language(root / "onnx" / "model.onnx", run_vision(root / vision.path, other), prompt, 0,
                          len(prompt) + 4)["logits"][0]
    assert np.abs(first - second).max() > 1e-3


def test_an_image_split_over_two_prefill_chunks_gives_the_same_logits(exported):
    """image_idx_output carries the next row into the next chunk, as the device's chunked prefill needs."""
    from pipelines.targets.qaic.ort import _empty_state, session

    family, model, root, _report, vision = exported
    embeds = run_vision(root / vision.path, family.vision_inputs(model.config, 0))
    prompt = image_prompt(family, model.config, TEXT)
    whole = run_language(root / "onnx" / "model.onnx", embeds, prompt, 0, 32)["logits"][0]
    sess = session(root / "onnx" / "model.onnx")
    state = _empty_state(sess, 1, 32)
    names = [o.name for o in sess.get_outputs()]
    image = {"vision_embeds": embeds, "image_idx": np.zeros((1, 1), np.int64)}
    for lo, hi in ((0, 9), (9, len(prompt))):  # the split falls inside the image rows
        feed = {"input_ids": np.asarray([prompt[lo:hi]]), "position_ids": np.arange(lo, hi)[None],
                "batch_index": np.zeros((1, 1), np.int64), **image, **state}
        res = dict(zip(names, sess.run(names, feed)))
        state = {k: res[f"{k}_RetainedState"] for k in state}
        image = {"vision_embeds": res["vision_embeds_RetainedState"], "image_idx": res["image_idx_output"]}
    assert int(image["image_idx"][0, 0]) == 16
    assert np.abs(res["logits"][0, 0] - whole).max() < 1e-4


def test_the_graph_contract(exported):
    _family, _model, root, report, vision = exported
    names, outputs, dims = language_io(root)
    assert names[:4] == ["input_ids", "vision_embeds", "position_ids", "image_idx"] and names[-1] == "batch_index"
    assert outputs[:3] == ["logits", "vision_embeds_RetainedState", "image_idx_output"]
    assert dims["vision_embeds"] == ["vision_batch_size", "vision_size", 64]
    vis = onnx.load(str(root / vision.path), load_external_data=False).graph
    assert [i.name for i in vis.input if i.name not in {t.name for t in vis.initializer}] == ["pixel_values"]
    assert [o.name for o in vis.output] == ["vision_embeds"]
    assert vision.path == f"{VISION_DIR}/model.onnx" and vision.float_inputs == ["pixel_values"]
    assert vision.symbols == {"batch_size": "1", "img_size": "56"} and report.layers == 2
    assert vision.vision_size == (56 // 14) ** 2  # one image of 56 pixels in patches of 14, CLS dropped


def dual_compile_inputs(report, vision, opts) -> tuple[dict[str, bytes], list[dict]]:
    """The dual QPC's compile inputs (SDK 1.22) of an export and its language specializations (Prefill, Decode)."""
    files = compile_files(report.layers, opts, "1.22", vision=vision.to_json())
    specs = json.loads(files["compile/specializations.json"])["specializations"]
    assert [s["name"] for s in specs] == ["Prefill", "Decode"]
    return files, specs


def test_the_compile_inputs_and_commands_of_the_dual_qpc(exported):
    _family, _model, _root, report, vision = exported
    info = vision.to_json()
    opts = CompileOptions.parse({"num_cores": 4, "ctx_len": 256, "prefill_seq_len": 32})
    files, specs = dual_compile_inputs(report, vision, opts)
    assert all(s["symbols"]["vision_size"] == "16" and s["symbols"]["vision_batch_size"] == "1" for s in specs)
    io = files["compile/custom_io.yaml"].decode()
    assert "- IOName: vision_embeds\n  Precision: float16" in io
    assert "- IOName: vision_embeds_RetainedState\n  Precision: float16" in io and "past_key.1_RetainedState" in io
    assert json.loads(files["compile/vision/specializations.json"]) == {
        "specializations": [{"name": "Vision", "symbols": {"batch_size": "1", "img_size": "56"}}]}
    assert files["compile/vision/custom_io.yaml"].decode().split() == [
        "-", "IOName:", "pixel_values", "Precision:", "float16", "-", "IOName:", "vision_embeds", "Precision:", "float16"]
    lang, vis = command(opts, "onnx/model.onnx"), vision_command(opts, info)
    assert "-mxfp6-matmul" in lang and "-retained-state" in lang
    assert "-mxfp6-matmul" not in vis and "-retained-state" not in vis  # QEfficient: the vision QPC never MXFP6
    assert vis[3:] == ["-m={bundle}/onnx/vision/model.onnx", "-convert-to-fp16", "-aic-num-cores=4",
                       "-network-specialization-config={bundle}/compile/vision/specializations.json",
                       "-custom-IO-list-file={bundle}/compile/vision/custom_io.yaml", "-aic-binary-dir={qpc_vision}"]
    filled = fill(vis, Path("/b"), Path("/a/qpc"))
    assert filled[-1] == "-aic-binary-dir=/a/qpc-vision" and filled[3] == "-m=/b/onnx/vision/model.onnx"
    legacy = json.loads(compile_files(report.layers, opts, "1.20", vision=info)["compile/vision/specializations.json"])
    assert legacy == {"specializations": [{"batch_size": "1", "img_size": "56"}]}


def test_every_declared_family_names_its_architectures_once():
    assert "LlavaForConditionalGeneration" in VISION_FAMILIES
    for arch, family in VISION_FAMILIES.items():
        assert arch in family.architectures
    from pipelines.core.errors import NotApplicableError

    with pytest.raises(NotApplicableError, match="no AI 100 vision-language export for FooForConditionalGeneration"):
        vision_family({"architectures": ["FooForConditionalGeneration"]})


@pytest.mark.parametrize("arch", sorted(TINY))
def test_each_family_goes_through_check_export_bundle_and_standin_compile(arch, smollm2_dir, tmp_path):
    """check routes a tiny model of each family to the qaic recipes; the build exports both graphs (ORT parity
    gated), writes the dual bundle (quality predicted on both QPCs), and the STAND-IN compile builds both programs
    (its specializations must name the graphs' own symbols) and binds vllm-qaic to `<vision_qpc>:<language_qpc>`
    with one image per prompt."""
    from qaic_flow import run_flow
    from qaic_standin import LABEL

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    model_dir = TINY[arch](tmp_path / "vlm", vocab=vocab + 1, image_token=vocab)
    family = VISION_FAMILIES[arch]
    config = load_vlm(model_dir).config
    # a random tiny model's logits are near-ties, so MXFP6 flips many of them: the gate here is the plumbing
    flow = run_flow(tmp_path, model_dir, smollm2_dir, "test-org/tiny-vlm", "qaic-mxfp6", "qaic-vlm-tiny",
                    {"num_cores": 2, "ctx_len": 256, "prefill_seq_len": 32}, validation={"min_predicted_top1": 0.3})
    assert {"qaic-export", "qaic-mxfp6", "qaic-fp16", "qaic-vlm-tiny"} <= set(flow.check["recipes"]), flow.check
    export, m = flow.export, flow.export["validation"]["metrics"]
    assert export["build"]["export"]["vision"]["vision_size"] == family.vision_size(config)
    assert m["ort_top1_agreement"] == 1.0 and m["ort_max_abs_delta"] < 1e-3 and m["ort_vision_max_abs_delta"] < 1e-4, m
    assert {"onnx/vision/model.onnx", "onnx/vision/model.onnx.data", "onnx/model.onnx"} <= {f["path"] for f in export["files"]}
    assert flow.bundle["build"]["compile"]["vision_command"][-1] == "-aic-binary-dir={qpc_vision}"
    q = flow.bundle["validation"]["mxfp6"]
    assert q["emulated"] == ["fp16 vision weights", "mxfp6 language weights", "mxint8 kv cache"] and q["positions"] > 20
    pulled, served = flow.pulled, flow.served
    argv = pulled["serve_argv"]
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"image": 1}'
    language = json.loads((served / "qpc" / "programqpc.bin").read_bytes()[len(LABEL):])
    vision = json.loads((served / "qpc-vision" / "programqpc.bin").read_bytes()[len(LABEL):])
    assert [s["name"] for s in vision["specializations"]] == ["Vision"] and "-mxfp6-matmul" not in vision["flags"]
    assert vision["specializations"][0]["symbols"] == family.vision_symbols(config)
    assert language["custom_io"]["vision_embeds"] == "float16" and "-mxfp6-matmul" in language["flags"]
    assert language["specializations"][0]["symbols"]["vision_size"] == str(family.vision_size(config))
    assert pulled["env"]["VLLM_QAIC_QPC_PATH"] == f"{served}/qpc-vision:{served}/qpc"
    assert pulled["serve_refused"] is None, pulled["serve_refused"]  # the serve policy runs what the kind wrote


def single_qpc_parity(family, model, root: Path, vision, out: Path, steps: int = 6) -> dict:
    """The single-QPC graph composed from an export in `root` (into `out`, beside hard links of the export's data
    files, as a bundle places them) run in onnxruntime against transformers' whole model: prefill with the image,
    then decode steps feeding pixel_values_RetainedState back. Shared by every family's tests."""
    from pipelines.targets.qaic.vision.parity import _reference
    from pipelines.targets.qaic.vision.single import SINGLE_ONNX, run_single, write_single

    for rel in ("onnx/model.onnx.data", f"{VISION_DIR}/model.onnx.data"):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(root / rel, out / rel)  # (onnxruntime refuses data behind a symlink out of the model's directory)
    assert write_single(root, vision.to_json(), out) == SINGLE_ONNX
    graph = onnx.load(str(out / SINGLE_ONNX), load_external_data=False).graph
    inputs = family.vision_inputs(model.config, 0)
    prompt = image_prompt(family, model.config, TEXT)
    positions = None if family.positions is None else family.positions(model.config, prompt, inputs)
    got = run_single(out / SINGLE_ONNX, inputs, prompt, steps, len(prompt) + 16, positions)
    ref = _reference(family, model, prompt + got["tokens"][:-1], inputs)[len(prompt) - 1:]
    return {"inputs": [i.name for i in graph.input], "outputs": [o.name for o in graph.output],
            "bytes": (out / SINGLE_ONNX).stat().st_size, "tokens": got["tokens"], "steps": len(got["logits"]),
            "reference_tokens": [int(r.argmax()) for r in ref],
            "max_abs_logit_delta": max(float(np.abs(r - g).max()) for r, g in zip(ref, got["logits"]))}


@pytest.mark.parametrize("case", ["LlavaForConditionalGeneration", "InternVLForConditionalGeneration"])
def test_the_single_qpc_graph_composed_from_both_matches_transformers(case, tmp_path_factory):
    """kv_offload: false: one graph (vision/single.py) takes the image beside the text and keeps it as device
    state; composed from the export's two graphs by reference (no weight copied), run in onnxruntime against
    transformers' whole model, the image fed back from pixel_values_RetainedState on every decode step."""
    family, model, root, _report, vision = _export(tmp_path_factory, case)
    r = single_qpc_parity(family, model, root, vision, tmp_path_factory.mktemp("single"))
    assert r["bytes"] < 2 << 20  # the graph only: weights stay in the export's files
    assert r["inputs"][:2] == ["input_ids", "pixel_values"] and "vision_embeds" not in r["inputs"] + r["outputs"]
    assert r["outputs"][:3] == ["logits", "pixel_values_RetainedState", "image_idx_output"]
    assert r["steps"] == 7 and r["tokens"] == r["reference_tokens"] and r["max_abs_logit_delta"] < 1e-3, r


def test_the_single_qpc_compile_inputs_and_its_refusals(exported):
    from pipelines.targets.qaic.vision.compile import form_problem, language_onnx

    _family, _model, _root, report, vision = exported
    info = vision.to_json()
    opts = CompileOptions.parse({"num_cores": 4, "ctx_len": 256, "prefill_seq_len": 32, "full_batch_size": None,
                                 "kv_offload": False})
    files = compile_files(report.layers, opts, "1.22", vision=info)
    assert not any(rel.startswith("compile/vision/") for rel in files)  # one program
    specs = json.loads(files["compile/specializations.json"])["specializations"]
    assert [s["symbols"] for s in specs] == [
        {"batch_size": "1", "seq_len": "32", "ctx_len": "256", "img_size": "56"},
        {"batch_size": "1", "seq_len": "1", "ctx_len": "256", "img_size": "56"}]
    io = files["compile/custom_io.yaml"].decode()
    assert "- IOName: pixel_values\n  Precision: float16" in io and "- IOName: pixel_values_RetainedState\n" in io
    assert "vision_embeds" not in io
    assert language_onnx(info, opts) == "onnx/model-single.onnx" and form_problem(info, opts) is None
    assert command(opts, language_onnx(info, opts))[3] == "-m={bundle}/onnx/model-single.onnx"
    assert "dual QPC only" in form_problem({**info, "architecture": "LlavaNextForConditionalGeneration",
                                            "single_qpc": False}, opts)
    assert "for vision-language models" in form_problem(None, opts)
    assert form_problem(None, CompileOptions.parse({})) is None
    assert CompileOptions.problems({"kv_offload": False}) == [
        "options: kv_offload: false compiles a single QPC, which runs one sequence at a time (continuous batching is dual-QPC "
        "only): batch_size must be 1 and full_batch_size null"]
    assert CompileOptions.parse({}).recorded() == CompileOptions.parse({"kv_offload": True}).recorded()
    assert "kv_offload" not in CompileOptions.parse({}).recorded()  # earlier bundles keep their bytes


def test_a_single_qpc_goes_through_bundle_standin_compile_and_pull(smollm2_dir, tmp_path):
    """LLaVA with kv_offload: false: the bundle carries the composed graph, the STAND-IN compiler builds one
    program from it (symbols and custom IO checked against that graph), served from one QPC path, one sequence."""
    from qaic_flow import run_flow
    from qaic_standin import LABEL

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    model_dir = tiny_llava(tmp_path / "vlm", vocab=vocab + 1, image_token=vocab)
    flow = run_flow(tmp_path, model_dir, smollm2_dir, "test-org/tiny-vlm", "qaic-mxfp6", "qaic-vlm-single",
                    {"num_cores": 2, "ctx_len": 256, "prefill_seq_len": 32, "full_batch_size": None,
                     "kv_offload": False}, validation={"min_predicted_top1": 0.3})
    assert "onnx/model-single.onnx" in {f["path"] for f in flow.bundle["files"]}
    compile_doc = flow.bundle["build"]["compile"]
    assert "vision_command" not in compile_doc and compile_doc["command"][3] == "-m={bundle}/onnx/model-single.onnx"
    assert compile_doc["options"]["kv_offload"] is False
    pulled, served = flow.pulled, flow.served
    program = json.loads((served / "qpc" / "programqpc.bin").read_bytes()[len(LABEL):])
    assert program["custom_io"]["pixel_values_RetainedState"] == "float16"
    assert program["specializations"][0]["symbols"]["img_size"] == "56"
    assert not (served / "qpc-vision").exists()
    assert pulled["env"]["VLLM_QAIC_QPC_PATH"] == f"{served}/qpc"
    argv = pulled["serve_argv"]
    assert argv[argv.index("--max-num-seqs") + 1] == "1" and pulled["serve_refused"] is None


def test_beyond_the_budget_the_checks_stream_the_vlm_and_onnxruntime_runs_a_layer_slice(smollm2_dir, tmp_path,
                                                                                        monkeypatch):
    """What a 70B VLM does on a small host, on a tiny 4-layer LLaVA under a budget its whole language graph does not
    fit: the parity runs onnxruntime on a graph of its first 2 layers (over the same data file) against the VLM
    streamed unit by unit with the same 2 layers, and the quality prediction streams too; both agree with the
    resident runs of the same layers and model."""
    from pipelines.model.memory import model_facts
    from pipelines.source.fetch import fetch_local
    from pipelines.source.snapshot import parse_source
    from pipelines.targets.qaic.plan import ort_check, ort_memory
    from pipelines.targets.qaic.vision import target
    from pipelines.validation.tokenizer_cache import CachedTokenizer

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    model_dir = tiny_llava(tmp_path / "llava", vocab=vocab + 1, image_token=vocab, text_layers=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((smollm2_dir / name).read_bytes())
    snap = fetch_local(parse_source(str(model_dir)), "test-org/tiny-llava")
    family = VISION_FAMILIES["LlavaForConditionalGeneration"]
    root = tmp_path / "export"
    export_vlm(family, model_dir, root, batch_index=True)
    facts = model_facts(snap)
    tight = ort_memory(facts, None, "float16") - 1  # the whole language graph no longer fits
    assert ort_check(facts, tight, "float16").layers == 2
    tok = CachedTokenizer(model_dir)
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", str(tight))
    metrics, details = target.parity(snap, root, root / "onnx" / "model.onnx", tok, 4, "float16")
    assert details["ort_check"]["mode"] == "slice" and details["ort_check"]["layers"] == 2
    assert (root / "onnx" / "slice-2.onnx").is_file()
    assert metrics["ort_top1_agreement"] == 1.0 and metrics["ort_max_abs_delta"] < 1e-3, (metrics, details)
    streamed = target.quality(snap, tok, mxfp6=True, mxint8=True)
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", "64G")
    resident = target.quality(snap, tok, mxfp6=True, mxint8=True)
    assert (streamed["resident"], resident["resident"]) == (False, True)
    assert streamed["positions"] == resident["positions"] > 20
    assert abs(streamed["kl"] - resident["kl"]) < 1e-4 and streamed["top1"] == resident["top1"], (streamed, resident)
