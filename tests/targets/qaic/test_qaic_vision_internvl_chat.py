"""InternVLChatModel (OpenGVLab's remote-code InternVL repositories) on AI 100 as transformers' native
InternVLForConditionalGeneration, through its declaration (pipelines/model/native_internvl.py), never its code.

A tiny random native InternVL (InternViT with a fused-able attention, a Qwen2 decoder) is written out in the remote
layout by this file's own mapping (the remote module names: `vision_model.encoder.layers.N.attn.qkv`, `ls1`,
`norm1`, `mlp1.0/1/3`, `language_model.model.*`), beside a config.json written by hand whose `auto_map` names a
modeling file that raises if anything imports it, and SmolLM2's BPE cut to 2,048 tokens with `<img>`, `</img>` and
`<IMG_CONTEXT>` added. Then: the declaration gives back every native parameter exactly; `check --hardware
qaic-ai100` answers the qaic recipes without review; the export's two graphs run in onnxruntime against transformers'
native model loaded (from_pretrained) from the converted weights, both halves and end to end; the whole path runs
to a pulled QPC whose config is the native form's; and a language model hive-aot does not declare is refused in one
line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_qaic_vision import TEXT, assert_end_to_end, language_io

from pipelines.core.errors import HiveError, ModelFormatError, NotApplicableError

ARCH = "InternVLChatModel"
IMAGE_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>")
RAISING_CODE = 'raise RuntimeError("the remote modeling code of this test repository was executed")\n'


def native_model(vocab: int, image_token: int, text: str = "qwen2", qk_norm: bool = False):
    """A random transformers InternVLForConditionalGeneration: tiles of 28 pixels in patches of 14, pixel shuffle 0.5
    (one row per tile), a 2-layer decoder. Layer scales, norms, CLS and positions are random too, so a tensor read
    into the wrong parameter shows."""
    from transformers import (
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLVisionConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    torch.manual_seed(0)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, initializer_range=0.1,
                 tie_word_embeddings=False)
    text_config = {"qwen2": lambda: Qwen2Config(**sizes), "qwen3": lambda: Qwen3Config(head_dim=16, **sizes),
                   "llama": lambda: LlamaConfig(**sizes)}[text]()
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=[28, 28], patch_size=[14, 14], attention_bias=True, use_qk_norm=qk_norm,
                                  norm_type="rms_norm" if qk_norm else "layer_norm", initializer_range=0.1)
    cfg = InternVLConfig(vision_config=vision.to_dict(), text_config=text_config.to_dict(), image_token_id=image_token,
                         downsample_ratio=0.5, vision_feature_layer=-1, tie_word_embeddings=False)
    model = InternVLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") or "lambda_" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "cls_token" in name or "position_embeddings" in name or "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
    return model


# The remote InternVL layout, written here from its module names (modeling_internvl_chat / modeling_intern_vit):
# (native name fragment, remote name fragment), applied in order to every native parameter name.
_TO_REMOTE = (("model.vision_tower.", "vision_model."), (".encoder.layer.", ".encoder.layers."),
              ("embeddings.cls_token", "embeddings.class_embedding"),
              ("embeddings.position_embeddings", "embeddings.position_embedding"),
              ("embeddings.patch_embeddings.projection.", "embeddings.patch_embedding."),
              (".lambda_1", ".ls1"), (".lambda_2", ".ls2"), (".attention.projection_layer.", ".attn.proj."),
              (".attention.q_norm.", ".attn.q_norm."), (".attention.k_norm.", ".attn.k_norm."),
              (".layernorm_before.", ".norm1."), (".layernorm_after.", ".norm2."),
              ("model.multi_modal_projector.layer_norm.", "mlp1.0."), ("model.multi_modal_projector.linear_1.", "mlp1.1."),
              ("model.multi_modal_projector.linear_2.", "mlp1.3."), ("model.language_model.", "language_model.model."),
              ("lm_head.", "language_model.lm_head."))


def remote_tensors(model) -> dict[str, torch.Tensor]:
    """The model's parameters under the remote names, bf16 as the repositories ship them; the vision attention's q,
    k, v fused into one `attn.qkv` of [q; k; v] rows."""
    out: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        if ".attention.k_proj." in name or ".attention.v_proj." in name:
            continue
        if ".attention.q_proj." in name:
            kind = name.rsplit(".", 1)[1]
            parts = [params[name.replace(".q_proj.", f".{x}_proj.")] for x in "qkv"]
            p, name = torch.cat(parts), name.replace(".attention.q_proj.", ".attn.qkv.")
            assert name.endswith(f"attn.qkv.{kind}")
        for native, remote in _TO_REMOTE:
            name = name.replace(native, remote)
        out[name] = p.detach().to(torch.bfloat16).contiguous()
    return out


def small_tokenizer_with_image_tokens(dest: Path, small_vocab_dir: Path) -> tuple[Path, int]:
    """SmolLM2's BPE cut to 2,048 tokens plus InternVL's image tokens: (its directory, the model's vocab size)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(small_vocab_dir))
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    dest.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(dest))
    return dest, len(tok)


def remote_config(model, **changes) -> dict:
    """config.json as InternVLChatConfig writes it (transformers 4 dumps: the llm_config and vision_config carry
    their library's every default field and InternViT's MoE leftovers)."""
    text, vision = model.config.text_config, model.config.vision_config
    llm = {**{k: v for k, v in text.to_dict().items() if k not in ("rope_parameters", "dtype")},
           "architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[
               text.model_type]],
           "_name_or_path": "./pretrained/Qwen2.5-0.5B-Instruct", "rope_theta": text.rope_parameters["rope_theta"],
           "rope_scaling": {"factor": 2.0, "rope_type": "dynamic", "type": "dynamic"}, "torch_dtype": "bfloat16",
           "use_bfloat16": True, "moe_config": None, "bad_words_ids": None, "tie_encoder_decoder": False,
           "typical_p": 1.0, "return_dict_in_generate": False, "transformers_version": "4.37.2"}
    vit = {"architectures": ["InternVisionModel"], "model_type": "intern_vit_6b", "hidden_size": vision.hidden_size,
           "intermediate_size": vision.intermediate_size, "num_hidden_layers": vision.num_hidden_layers,
           "num_attention_heads": vision.num_attention_heads, "image_size": 448, "patch_size": 14,
           "hidden_act": "gelu", "layer_norm_eps": 1e-6, "norm_type": vision.norm_type, "num_channels": 3,
           "qkv_bias": vision.attention_bias, "qk_normalization": vision.use_qk_norm, "attention_dropout": 0.0,
           "dropout": 0.0, "drop_path_rate": 0.1, "initializer_factor": 0.1, "initializer_range": 1e-10,
           "use_flash_attn": False, "torch_dtype": "bfloat16", "_name_or_path": "OpenGVLab/InternViT-300M-448px-V2_5",
           "auto_map": {"AutoConfig": "configuration_intern_vit.InternVisionConfig",
                        "AutoModel": "modeling_intern_vit.InternVisionModel"},
           "use_moe": False, "num_experts": 8, "num_routed_experts": 4, "capacity_factor": 1.2}
    cfg = {"architectures": [ARCH], "model_type": "internvl_chat",
           "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                        "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                        "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel"},
           "downsample_ratio": 0.5, "dynamic_image_size": True, "force_image_size": 28, "hidden_size": text.hidden_size,
           "llm_config": llm, "max_dynamic_patch": 12, "min_dynamic_patch": 1, "pad2square": False, "ps_version": "v2",
           "select_layer": -1, "template": "internvl2_5", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "use_backbone_lora": 0, "use_llm_lora": 0, "use_thumbnail": True, "vision_config": vit}
    for key, value in changes.items():
        cfg[key] = value
    return cfg


def write_remote_checkpoint(model_dir: Path, tokenizer_dir: Path, text: str = "qwen2", qk_norm: bool = False,
                            **config_changes) -> tuple[Path, object]:
    """(a remote-layout InternVLChatModel repository, the native model it was written from)."""
    from safetensors.torch import save_file

    vocab_tokens = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    image_token = next(t["id"] for t in vocab_tokens if t["content"] == "<IMG_CONTEXT>")
    model = native_model(image_token + 1, image_token, text, qk_norm)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(remote_tensors(model), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(remote_config(model, **config_changes), indent=2))
    for name in ("modeling_internvl_chat.py", "configuration_internvl_chat.py"):
        (model_dir / name).write_text(RAISING_CODE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    return model_dir, model


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_small_vocab_dir, tmp_path_factory) -> Path:
    return small_tokenizer_with_image_tokens(tmp_path_factory.mktemp("tokenizer"), smollm2_small_vocab_dir)[0]


@pytest.fixture(scope="module")
def remote(tokenizer_dir, tmp_path_factory):
    return write_remote_checkpoint(tmp_path_factory.mktemp("internvl-chat") / "InternVL2_5-tiny", tokenizer_dir)


def converted_native_checkpoint(model_dir: Path, dest: Path) -> Path:
    """The remote checkpoint converted by the declaration (the export's own weight rules) and written in the native
    layout with the native config, for transformers' from_pretrained."""
    from safetensors.torch import save_file

    from pipelines.model.native import write_native_config
    from pipelines.model.streamed_model import meta_model, read_float32
    from pipelines.source.safetensors_io import TensorSource

    dest.mkdir(parents=True, exist_ok=True)
    with TensorSource(sorted(model_dir.glob("*.safetensors"))) as source:
        model, rules = meta_model(model_dir, set(source.names()))
        state = {name: rules[name].load(lambda t: read_float32(source, t)).contiguous()
                 for name, _p in model.named_parameters()}
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    write_native_config(model_dir, dest / "config.json")
    return dest


def test_the_declaration_gives_back_every_native_parameter_and_the_native_config(remote, tmp_path):
    from pipelines.model.native import native_config, native_dict, read_config
    from pipelines.targets.qaic.vision.export import load_vlm

    model_dir, original = remote
    config, eq = native_config(model_dir)
    assert eq.architecture == ARCH and config.architectures == ["InternVLForConditionalGeneration"]
    assert config.image_token_id == 2050 and tuple(config.vision_config.image_size) == (28, 28)  # force_image_size
    assert config.text_config.model_type == "qwen2" and config.vision_config.attention_bias is True
    assert config.vision_config.norm_type == "layer_norm" and config.vision_config.use_qk_norm is False
    assert (config.vision_feature_layer, config.vision_feature_select_strategy) == (-1, "default")
    assert config.tie_word_embeddings is False and config.image_seq_length == 1
    assert native_dict(read_config(model_dir))["text_config"]["num_hidden_layers"] == 2
    native = load_vlm(converted_native_checkpoint(model_dir, tmp_path / "native"))  # transformers' from_pretrained
    got = dict(native.named_parameters())
    want = dict(original.named_parameters())
    assert sorted(got) == sorted(want)
    for name, p in want.items():  # bf16 in the repository: exactly what the bf16 copy of the original holds
        assert torch.equal(got[name], p.detach().to(torch.bfloat16).float()), name
    assert not json.loads((tmp_path / "native" / "config.json").read_text()).get("auto_map")


@pytest.mark.parametrize("text,qk_norm", [("qwen3", True), ("llama", False)])
def test_the_other_declared_language_models_and_the_qk_normalized_tower_convert_exactly(text, qk_norm, tokenizer_dir,
                                                                                        tmp_path):
    """InternVL3.5's Qwen3, InternVL2-Llama3's Llama; InternViT-6B's RMSNorm with q/k normalization."""
    from pipelines.targets.qaic.vision.export import load_vlm

    model_dir, original = write_remote_checkpoint(tmp_path / "remote", tokenizer_dir, text, qk_norm)
    native = load_vlm(converted_native_checkpoint(model_dir, tmp_path / "native"))
    assert native.config.text_config.model_type == text and native.config.vision_config.use_qk_norm is qk_norm
    got = dict(native.named_parameters())
    assert any(".attention.q_norm." in n for n in got) is qk_norm
    for name, p in original.named_parameters():
        assert torch.equal(got[name], p.detach().to(torch.bfloat16).float()), name


def _check(model_dir: Path, config):
    from pipelines.compat.check import classify_snapshot
    from pipelines.source.fetch import fetch_local
    from pipelines.source.snapshot import parse_source

    snap = fetch_local(parse_source(str(model_dir)), "OpenGVLab/InternVL-tiny")
    return classify_snapshot(snap, recipes=config.recipes.values(), hardware="qaic-ai100", registry=config.registry)


def _detail(compat, name: str) -> str:
    return next(c.detail for c in compat.checks if c.name == name)


@pytest.mark.parametrize("case", [ARCH])  # the matrix names this test by its architecture
def test_the_remote_checkpoint_exports_and_matches_the_native_model_end_to_end(case, remote, config, tmp_path):
    """check routes the remote repository to the qaic recipes (its code never run, no review needed); the export
    reads it through the declaration; onnxruntime runs both graphs against transformers' native InternVL loaded
    from the converted weights: the vision graph alone, then prefill with the image's 13 tile rows and greedy
    decode, the first generated tokens equal."""
    from pipelines.targets.qaic.vision import vision_family
    from pipelines.targets.qaic.vision.export import export_vlm, load_vlm, round_language
    from pipelines.targets.qaic.vision.parity import vlm_parity
    from pipelines.targets.qaic.vision.target import _architectures

    model_dir, _original = remote
    compat = _check(model_dir, config)
    assert (compat.status, compat.runtime_profile_id) == ("compatible", "vllm-qaic"), compat.checks
    assert {"qaic-export", "qaic-mxfp6", "qaic-fp16"} <= set(compat.recipes), compat.recipes
    assert "in the AI 100 validated matrix" in _detail(compat, "architecture_known")
    remote_code = next(c for c in compat.checks if c.name == "remote_code")
    assert remote_code.status == "pass" and "never run and not trusted" in remote_code.detail
    assert "InternVLForConditionalGeneration" in remote_code.detail
    assert all(c.name != "trust_remote_code" for c in compat.checks)
    assert _detail(compat, "vocab_consistent") == "embedding rows match vocab_size"  # llm_config's vocab, read

    assert _architectures(model_dir) == ["InternVLForConditionalGeneration"]
    _arch, family = vision_family({"architectures": _architectures(model_dir)})
    root = tmp_path / "onnx"
    report, vision = export_vlm(family, model_dir, root, batch_index=True)
    assert vision.architecture == "InternVLForConditionalGeneration" and vision.image_token_id == 2050
    assert vision.vision_size == 13 and report.layers == 2  # 13 tiles of one row each
    names, _outputs, dims = language_io(root)
    assert names[:4] == ["input_ids", "vision_embeds", "position_ids", "image_idx"]
    assert dims["vision_embeds"] == ["vision_batch_size", "vision_size", 64]

    native = load_vlm(converted_native_checkpoint(model_dir, tmp_path / "native"))
    round_language(family, native, "float16")  # the language matrices as the export stores them
    r = vlm_parity(family, native, root / "onnx" / "model.onnx", root / vision.path, TEXT, decode_steps=8)
    print(f"InternVLChatModel parity: vision max |delta| {r['vision_max_abs_delta']:.3g}, language max |delta logit| "
          f"{r['max_abs_logit_delta']:.3g}, top-1 {r['top1_agreement']}, tokens equal {r['tokens_equal']}")
    assert_end_to_end(r, vision.vision_size)


def test_the_whole_path_serves_the_native_form(remote, smollm2_dir, tokenizer_dir, tmp_path):
    """check -> export (ORT parity gated) -> bundle (quality predicted on both QPCs) -> STAND-IN compile -> pull, from
    the remote repository: the published config is the native form's (no auto_map), served without
    --trust-remote-code."""
    import shutil

    from qaic_flow import run_flow

    model_dir = shutil.copytree(remote[0], tmp_path / "InternVL2_5-tiny")
    flow = run_flow(tmp_path, model_dir, tokenizer_dir, "OpenGVLab/InternVL-tiny", "qaic-mxfp6", "qaic-vlm-tiny",
                    {"num_cores": 2, "ctx_len": 256, "prefill_seq_len": 32}, validation={"min_predicted_top1": 0.3})
    assert flow.check["status"] == "compatible" and "qaic-vlm-tiny" in flow.check["recipes"], flow.check
    export, m = flow.export, flow.export["validation"]["metrics"]
    assert export["build"]["export"]["converted_from"] == ARCH
    assert export["build"]["export"]["vision"]["architecture"] == "InternVLForConditionalGeneration"
    assert m["ort_top1_agreement"] == 1.0 and m["ort_max_abs_delta"] < 1e-3 and m["ort_vision_max_abs_delta"] < 1e-4, m
    served = json.loads((flow.served / "config.json").read_text())
    assert served["architectures"] == ["InternVLForConditionalGeneration"] and "auto_map" not in served
    assert served["image_token_id"] == 2050 and served["text_config"]["model_type"] == "qwen2"
    assert not (flow.served / "modeling_internvl_chat.py").exists()
    argv = flow.pulled["serve_argv"]
    assert "--trust-remote-code" not in argv and flow.pulled["serve_refused"] is None, flow.pulled


@pytest.mark.parametrize("changes,error,message", [
    ({"llm_config": {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "hidden_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 2051}}, NotApplicableError,
     "InternVLChatModel with language model InternLM2ForCausalLM: hive-aot builds InternVLChatModel as transformers' "
     "InternVLForConditionalGeneration with a Qwen2ForCausalLM, Qwen3ForCausalLM or LlamaForCausalLM language model "
     "only"),
    ({"ps_version": "v1"}, NotApplicableError,
     "InternVLChatModel with ps_version 'v1': its pixel shuffle leaves the image rows transposed"),
    ({"downsample_ratio": "half"}, ModelFormatError,
     "config.json of InternVLChatModel does not translate to InternVLForConditionalGeneration: ValueError"),
], ids=["internlm2-language-model", "ps_version-v1", "malformed-field"])
def test_a_repository_without_a_native_form_is_refused_in_one_line(changes, error, message, remote, config, tmp_path):
    """check says why (no recipe, never routed), and so do the native config and the export, before any work."""
    import shutil

    from pipelines.model.native import native_config
    from pipelines.targets.qaic.vision import VISION_FAMILIES
    from pipelines.targets.qaic.vision.export import export_vlm

    model_dir = shutil.copytree(remote[0], tmp_path / "bad")
    cfg = {**json.loads((model_dir / "config.json").read_text()), **changes}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    compat = _check(model_dir, config)
    assert (compat.status, compat.runtime_profile_id, compat.recipes) == ("incompatible", None, []), compat.checks
    known = _detail(compat, "architecture_known")
    assert message in known and "\n" not in known
    for call in (lambda: native_config(model_dir),
                 lambda: export_vlm(VISION_FAMILIES["InternVLForConditionalGeneration"], model_dir, tmp_path / "x")):
        with pytest.raises(error) as refused:
            call()
        assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_tokenizer_without_the_image_context_token_or_a_config_without_sizes_is_refused(remote, tmp_path):
    import shutil

    from pipelines.model.native import native_config

    model_dir = shutil.copytree(remote[0], tmp_path / "no-token")
    (model_dir / "tokenizer.json").write_text(
        (model_dir / "tokenizer.json").read_text().replace("<IMG_CONTEXT>", "<IMG_CTX>"))
    (model_dir / "tokenizer_config.json").write_text(
        (model_dir / "tokenizer_config.json").read_text().replace("<IMG_CONTEXT>", "<IMG_CTX>"))
    with pytest.raises(ModelFormatError, match="the tokenizer declares no <IMG_CONTEXT> token"):
        native_config(model_dir)
    cfg = json.loads((remote[0] / "config.json").read_text())
    del cfg["vision_config"]["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HiveError, match=r"config.json has no vision_config.hidden_size \(needed for InternVLChatModel\)"):
        native_config(model_dir)


def test_the_remote_code_is_never_imported(remote):
    """The repository's modeling files raise when imported: nothing above imported them (transformers would have
    loaded them as `transformers_modules.<repo>.modeling_internvl_chat`)."""
    import sys

    model_dir, _original = remote
    assert (model_dir / "modeling_internvl_chat.py").read_text() == RAISING_CODE
    assert [n for n in sys.modules if n.rsplit(".", 1)[-1] in ("modeling_internvl_chat", "configuration_internvl_chat")] == []
