"""The vision projector of a VLM as llama.cpp's `mmproj` GGUF (pipelines/targets/gguf/mmproj.py, projectors.py,
mmproj_check.py) for LLaVA-1.5, Gemma 3, Qwen2-VL, Qwen2.5-VL and Qwen3-VL, on the tiny random models of
test_gguf_families_vlm.py:

- tensors byte-identical to llama.cpp's converter with `--mmproj` (and the same `clip.*` keys); for LLaVA-1.5,
  which that converter does not write, to llama.cpp's legacy LLaVA script (its surgery's inputs made here, the
  script run with transformers 5's CLIPVisionModel given back transformers 4's `vision_model` attribute), with
  the MLP's ffn_up / ffn_down named the right way round and `clip.vision.feature_layer` added;
- every checkpoint layout (as released, as transformers 5.23 saves it, transformers 5's nested one) gives the
  same file;
- one synthetic image through libmtmd (llama-cpp-python's bindings) against transformers' `get_image_features`:
  cosine >= 0.9999 per image token for Gemma 3, Qwen2.5-VL and Qwen3-VL (DeepStack rows included). LLaVA-1.5 is
  not gated: llama.cpp 0.3.36's llava graph puts the class token after the patches, which the file cannot undo;
  its output equals transformers' tower run that way (shown here), so the file is right and the runtime differs;
- a negative control (Gemma's 1 + w norm), one-line refusals, and a whole build (check, build, validate,
  publish) of a Gemma 3 VLM with both files in its manifest and the projector's numbers in its validation.

The llama.cpp converter reads Gemma 3's tower only under its released name (`vision_tower.vision_model.*`,
which transformers 5.23 does not write), so its yardstick runs on the released layout.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from factories import copy_model, rewrite_safetensors, write_test_config
from gguf_family_check import assert_refused, convert_only, tensors
from gguf_reader import FastGGUFReader
from test_gguf_families_vlm import build_vlm, renamed

from pipelines.core.errors import ModelFormatError
from pipelines.source.fetch import fetch
from pipelines.targets.gguf import mmproj_check, projectors
from pipelines.targets.gguf.families.spec import IDENTITY
from pipelines.targets.gguf.mmproj import convert_mmproj, mmproj_name, projector_hparams
from pipelines.targets.gguf.projectors import projector_for

RELEASED = (("vision_tower.", "vision_tower.vision_model."),)  # LLaVA / Gemma 3 as released, from 5.23's save
# transformers 5's module names, from the released layout (Qwen3-VL, released nested: flattened the other way)
NESTED = (("vision_tower.vision_model.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
          ("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
          ("visual.", "model.visual."), ("model.visual.", "visual."))
LLAMACPP_MMPROJ = ["gemma3_vlm", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"]
VALIDATED = ["gemma3_vlm", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """The tiny VLM of a case (test_gguf_families_vlm.CASES) in its released layout, built once per module."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-mmproj-models")

    def build(name: str) -> Path:
        if name not in built:
            d = build_vlm(name, root / f"{name}-saved", smollm2_small_vocab_dir)
            built[name] = renamed(d, root / name, RELEASED) if name in ("llava", "gemma3_vlm") else d
        return built[name]

    return build


def write_mmproj(d: Path, out: Path) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    return convert_mmproj(projector_for(cfg["architectures"][0]), d, cfg, sorted(d.glob("*.safetensors")), out,
                          name=f"test/{d.name}")


def clip_keys(path: Path) -> dict:
    fields = FastGGUFReader(str(path)).fields
    return {k: fields[k].contents() for k in fields if k.startswith("clip.")}


def same_bytes(a: Path, b: Path, names=lambda n: n) -> None:
    x, y = tensors(a), {names(n): t for n, t in tensors(b).items()}
    assert sorted(x) == sorted(y)
    assert [n for n in x if x[n].tensor_type != y[n].tensor_type or list(x[n].shape) != list(y[n].shape)
            or np.asarray(x[n].data).tobytes() != np.asarray(y[n].data).tobytes()] == []


# --- byte identity with llama.cpp's writers -------------------------------------------------------------------

@pytest.mark.parametrize("name", LLAMACPP_MMPROJ)
def test_same_projector_as_llamacpp(name, model, llamacpp_tree, tmp_path):
    import llamacpp_converter

    d = model(name)
    report = write_mmproj(d, tmp_path / "ours.gguf")
    theirs = llamacpp_converter.convert(llamacpp_tree, d, tmp_path / "theirs.gguf", "f16", "--mmproj")
    assert llamacpp_converter.tensor_differences(tmp_path / "ours.gguf", theirs) == []
    assert clip_keys(tmp_path / "ours.gguf") == clip_keys(theirs)
    fields = FastGGUFReader(str(tmp_path / "ours.gguf")).fields
    assert fields["general.architecture"].contents() == "clip" and fields["general.type"].contents() == "mmproj"
    assert report["tensors"] == len(tensors(theirs))


def _legacy_llava(tree: Path, d: Path, work: Path) -> Path:
    """llama.cpp's legacy LLaVA path on `d`: the surgery's outputs (the CLIP tower as its own model, the projector's
    tensors in `llava.projector`), then convert_image_encoder_to_gguf.py from the pinned sdist."""
    import llamacpp_converter
    import torch
    from safetensors.numpy import load_file, save_file

    sdist = tree.parent / f"llama_cpp_python-{llamacpp_converter.LLAMA_CPP_VERSION}.tar.gz"
    script = work / "convert_image_encoder_to_gguf.py"
    with tarfile.open(sdist) as tf:
        script.write_bytes(tf.extractfile(llamacpp_converter.VENDOR + "tools/mtmd/legacy-models/" + script.name).read())
    t = load_file(str(d / "model.safetensors"))
    clip = work / "clip"
    clip.mkdir()
    save_file({n[len("vision_tower."):]: v for n, v in t.items() if n.startswith("vision_tower.")},
              str(clip / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (clip / "config.json").write_text(json.dumps({**cfg["vision_config"], "architectures": ["CLIPVisionModel"]}))
    torch.save({n: torch.from_numpy(v) for n, v in t.items() if n.startswith("multi_modal_projector.")},
               work / "llava.projector")
    child = (
        "import sys, runpy\n"
        "sys.path.insert(0, sys.argv.pop(1))\n"
        "from transformers.models.clip import modeling_clip as m\n"
        "m.CLIPVisionModel.vision_model = property(lambda self: self)\n"
        "flat = m.CLIPVisionModel.state_dict\n"
        "m.CLIPVisionModel.state_dict = lambda self, *a, **k: {'vision_model.' + n: v\n"
        "                                                      for n, v in flat(self, *a, **k).items()}\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", child, str(tree / "gguf-py"), str(script), "-m", str(clip),
                           "--llava-projector", str(work / "llava.projector"), "--output-dir", str(work / "out"),
                           "--clip-model-is-vision"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "out" / "mmproj-model-f16.gguf"


def test_llava_projector_is_the_legacy_scripts(model, llamacpp_tree, tmp_path):
    d = model("llava")
    write_mmproj(d, tmp_path / "ours.gguf")
    theirs = _legacy_llava(llamacpp_tree, d, tmp_path)
    swap = {"ffn_up": "ffn_down", "ffn_down": "ffn_up"}  # the legacy names, which libmtmd swaps back by shape

    def named(n: str) -> str:
        parts = n.split(".")
        return ".".join(parts[:3] + [swap.get(parts[3], parts[3])] + parts[4:]) if len(parts) > 4 else n

    same_bytes(tmp_path / "ours.gguf", theirs, named)
    ours, legacy = clip_keys(tmp_path / "ours.gguf"), clip_keys(theirs)
    # the same tower and projector description, feature layer named, projection_dim as the modern converter means it
    assert ours.pop("clip.vision.feature_layer") == [2] and ours.pop("clip.vision.projection_dim") == 64
    legacy.pop("clip.vision.projection_dim")
    assert {k: v for k, v in legacy.items() if k != "clip.has_text_encoder"} == ours
    assert not {"v.post_ln.weight", "v.blk.2.ln1.weight"} & set(tensors(tmp_path / "ours.gguf"))


@pytest.mark.parametrize("name", ["llava", "gemma3_vlm", "qwen2_5_vl", "qwen3_vl"])
def test_every_layout_gives_the_same_projector(name, model, tmp_path):
    d = model(name)
    write_mmproj(d, tmp_path / "released.gguf")
    layouts = [renamed(d, tmp_path / "nested", NESTED)]
    if name in ("llava", "gemma3_vlm"):  # as transformers 5.23 saves them (no `vision_model.`), and nested with it
        layouts.append(renamed(d, tmp_path / "saved", (("vision_tower.vision_model.", "vision_tower."),)))
        layouts.append(renamed(d, tmp_path / "nested-tower", (("vision_tower.", "model.vision_tower."),
                                                              ("multi_modal_projector.", "model.multi_modal_projector."))))
    for other in layouts:
        write_mmproj(other, tmp_path / f"{other.name}.gguf")
        same_bytes(tmp_path / "released.gguf", tmp_path / f"{other.name}.gguf")


# --- libmtmd against transformers' image features -------------------------------------------------------------

def _check(d: Path, tmp_path: Path, projector=None) -> tuple[list[str], dict]:
    convert_only(d, tmp_path / "lm.gguf")
    write_mmproj(d, tmp_path / "mmproj.gguf")
    snap = fetch(str(d), f"test/{d.name}")
    projector = projector or projector_for(snap.config()["architectures"][0])
    return mmproj_check.validate_mmproj(snap, tmp_path / "lm.gguf", tmp_path / "mmproj.gguf", projector, "test")


def test_llama_cpp_python_ships_libmtmd():
    assert mmproj_check.mtmd_available() is None


@pytest.mark.parametrize("name", VALIDATED)
def test_image_embeddings_match_transformers(name, model, tmp_path):
    failures, details = _check(model(name), tmp_path)
    print(name, details)
    assert failures == [] and "not_gated" not in details
    assert details["cosine_min"] >= 0.9999 and details["finite"] is True
    tokens, width = {"gemma3_vlm": (4, 64), "qwen2_5_vl": (16, 64)}.get(name, (16, 64 * 3))
    assert (details["tokens"], details["width"]) == (tokens, width)  # Qwen3-VL: the merger's rows and 2 DeepStack levels


def test_llava_runtime_divergence_is_reported_not_gated(model, tmp_path):
    """libmtmd's llava graph appends the class token after the patches and keeps rows 1..n: far from transformers'
    features, but equal to transformers' own tower run that way, so the file holds LLaVA's weights as they are."""
    import torch
    from transformers import AutoModelForImageTextToText

    d = model("llava")
    failures, details = _check(d, tmp_path)
    print("llava", details)
    assert failures == [] and details["not_gated"] == projectors.LLAVA.divergence
    assert details["cosine_min"] < 0.9
    vlm = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32).eval()
    hp = projector_hparams(projectors.LLAVA, json.loads((d / "config.json").read_text()), d)
    inputs = mmproj_check.pixel_inputs(projectors.LLAVA, hp, mmproj_check.synthetic_image(56))
    pixels = torch.from_numpy(inputs["pixel_values"])
    tower, emb = vlm.model.vision_tower, vlm.model.vision_tower.embeddings
    with torch.inference_mode():
        patches = emb.patch_embedding(pixels).flatten(2).transpose(1, 2)
        cls_last = torch.cat([patches, emb.class_embedding[None, None]], 1)  # libmtmd's order, positions 0..n
        h = tower.pre_layrnorm(cls_last + emb.position_embedding.weight[None])
        for layer in tower.encoder.layers[:2]:  # vision_feature_layer -2 of 3
            out = layer(h, None)
            h = out[0] if isinstance(out, tuple) else out
        emulated = vlm.model.multi_modal_projector(h[:, 1:])[0].numpy()
    got = _mtmd_rows(d, tmp_path)  # libmtmd's rows for the same image and files
    cos = (emulated * got).sum(-1) / np.linalg.norm(emulated, axis=-1) / np.linalg.norm(got, axis=-1)
    assert cos.min() > 0.9999, cos


def _mtmd_rows(d: Path, tmp_path: Path) -> np.ndarray:
    from pipelines.process.isolation import run_isolated

    np.save(tmp_path / "image.npy", mmproj_check.synthetic_image(56))
    run_isolated(mmproj_check.run_mtmd, engine="llama.cpp", step="test",
                 model_path=str(tmp_path / "lm.gguf"), mmproj_path=str(tmp_path / "mmproj.gguf"),
                 image=str(tmp_path / "image.npy"), out=str(tmp_path / "rows.npy"))
    return np.load(tmp_path / "rows.npy")


def test_gemma3_norm_offset_matters(model, tmp_path):
    """Negative control: Gemma's projector norm written as w (not 1 + w) loads and runs, and only the image
    embeddings show it."""
    gemma = projectors.GEMMA3
    rules = tuple(dataclasses.replace(r, transform=IDENTITY) if r.outputs == ("mm.soft_emb_norm.weight",) else r
                  for r in gemma.tensors)
    broken = dataclasses.replace(gemma, tensors=rules)
    d = model("gemma3_vlm")
    convert_only(d, tmp_path / "lm.gguf")
    cfg = json.loads((d / "config.json").read_text())
    convert_mmproj(broken, d, cfg, sorted(d.glob("*.safetensors")), tmp_path / "mmproj.gguf", name="test/broken")
    failures, details = mmproj_check.validate_mmproj(fetch(str(d), "test/gemma3"), tmp_path / "lm.gguf",
                                                     tmp_path / "mmproj.gguf", broken, "test")
    assert details["cosine_min"] < 0.99 and failures and failures[0].startswith("projector: image embeddings cosine")


# --- refusals -----------------------------------------------------------------------------------------------------

def _outer(**change):
    return lambda cfg: cfg.update(change)


def _vision(**change):
    return lambda cfg: cfg["vision_config"].update(change)


REFUSALS = [
    ("llava", _outer(vision_feature_select_strategy="full"), r"needs vision_feature_select_strategy 'default'"),
    ("llava", _outer(vision_feature_layer=[-2, -1]), r"needs one vision_feature_layer within the 3 layers"),
    ("llava", _vision(model_type="siglip_vision_model"), r"with a 'siglip_vision_model' vision tower is not supported"),
    ("qwen2_5_vl", _vision(fullatt_block_indexes=[1, 2]), r"needs evenly spaced fullatt_block_indexes"),
    ("qwen3_vl", _vision(temporal_patch_size=3), r"needs temporal_patch_size 2"),
    ("gemma3_vlm", _outer(mm_tokens_per_image=16), r"image_seq_length differs from mm_tokens_per_image \(16\)"),
]


@pytest.mark.parametrize("name,edit,message", REFUSALS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REFUSALS)])
def test_projectors_llama_cpp_cannot_run_are_refused(name, edit, message, model, tmp_path):
    assert_refused(model(name), tmp_path, edit, message, convert=write_mmproj)


def test_an_unmapped_vision_tensor_is_refused(model, tmp_path):
    d = copy_model(model("qwen2_5_vl"), tmp_path / "extra")
    rewrite_safetensors(d, lambda t: t.update({"visual.blocks.0.attn.extra.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(ModelFormatError, match=r"unmapped tensors for the qwen2\.5vl projector: visual\.blocks\.0\.attn"):
        write_mmproj(d, tmp_path / "x.gguf")


# --- the build ----------------------------------------------------------------------------------------------------

def test_a_vlm_build_publishes_the_model_and_its_projector(smollm2_dir, tmp_path):
    """check -> build -> validate -> publish of a Gemma 3 VLM (SmolLM2's full tokenizer, whose pre-tokenizer
    llama.cpp recognises): the manifest lists the language model and `mmproj-<name>-F16.gguf`, the build info
    describes the projector, the validation details hold its numbers, and llama-server is told to load it."""
    from pipelines.config.registry import Config
    from pipelines.engine.build import build_and_publish
    from pipelines.store.manifest import Manifest

    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    d = build_vlm("gemma3_vlm", tmp_path / "model", smollm2_dir, vocab_size=vocab)
    config = Config.load(write_test_config(tmp_path / "cfg", Path.cwd()))
    res = build_and_publish(str(d), "gguf-f16", config, str(tmp_path / "store"), "test-org/tiny-gemma3-vlm")
    assert res.state == "published", res
    mmproj = mmproj_name("test-org/tiny-gemma3-vlm")
    assert [f["path"] for f in res.files] == ["tiny-gemma3-vlm-F16.gguf", mmproj]
    manifest = Manifest.parse((tmp_path / "store" / res.manifest.split("/store/", 1)[1]).read_bytes(), "test")
    info = manifest.build["mmproj"]
    assert info["file"] == mmproj and info["projector_type"] == "gemma3"
    assert info["validation"].startswith("image embeddings of libmtmd")
    projector = res.validation["projector"]  # the validation details, in the manifest's validation record
    assert projector["cosine_min"] >= 0.9999, projector
    command = next(iter(manifest.serving.values()))["command"]
    assert command[command.index("--mmproj") + 1].endswith("/" + mmproj)


def test_mmproj_is_named_as_llama_cpp_names_it():
    assert mmproj_name("google/gemma-3-4b-it") == "mmproj-gemma-3-4b-it-F16.gguf"
