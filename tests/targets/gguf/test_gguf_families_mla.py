"""GGUF families DeepSeek-V3 / R1, Kimi-K2 and DeepSeek-V2 (llama.cpp's `deepseek2`: multi-head latent attention,
DeepSeek-style MoE) and GLM-4.5 / 4.6 (`glm4moe`) on tiny random models: converted to f16 and q8_0 and validated
in llama.cpp against transformers fp32 (`gguf_family_check.check_family`), f16 tensors byte-identical to llama.cpp's
own converter, the streamed direct Q4_K_M, what is special to each family (keys, shapes), negative controls for
the tensors and keys that matter, and the layouts llama.cpp cannot run (one-line refusals).

Every model carries SmolLM2's BPE cut to 2,048 tokens, each conversion naming its pre-tokenizer
(`gguf_family_check`). llama.cpp's converter reads GLM-4.5's special tokens by name ([gMASK], <|user|>,
<|observation|>), so the GLM model's copy has three of SmolLM2's unused special tokens renamed to them.

The cases keep the released configs' features at hidden 64: DeepSeek-V3 with a q LoRA rank, YaRN (mscale ==
mscale_all_dim, as released), one dense layer then MoE layers of 4 routed experts + 1 shared, sigmoid routing with a
random correction bias, within the best of 2 expert groups, renormalized and scaled 2.5x; DeepSeek-V2-Lite with a
plain q_proj, softmax routing, 2 shared experts and YaRN at mscale 0.707; Kimi-K2's released config (model_type
kimi_k2, auto_map, `rope_scaling` of type yarn, 16 experts of which 8 are used, one group: refused for its YaRN betas,
which llama.cpp does not read, and converted with llama.cpp's); GLM-4.5 with q/k/v
biases, q/k norms, a partial rope, a dense layer, a MoE layer and its NextN layer. MLA's widths are multiples of 32
so every matrix row is whole q8_0 blocks. Released checkpoints append the multi-token-prediction layer after the
trunk (DeepSeek-V3's model.layers.61, GLM-4.5-Air's 46), which transformers' save_pretrained does not write: the
tiny checkpoints get one, a whole decoder layer plus eh_proj, enorm, hnorm, embed_tokens and shared_head, as
released (llama.cpp's converter drops DeepSeek's and keeps GLM's, and so does hive-aot).

Routers: weights 0.1 as in test_gguf_families_moe.py; the softmax router (DeepSeek-V2) scaled 4x, the sigmoid ones
2x: at 4x sigmoid scores saturate, and the sums of a group's two best scores, by which DeepSeek-V3 picks its
groups, tie (measured, seeds 0-3 at 4x: one or two positions flip their group at f16, f16 KL 1.5e-4 - 3.8e-4 with a
position at KL 0.11 - 0.29; seeds 0-2 at 2x: none, KL 6e-7). The correction biases are buffers, which make_causal_lm
leaves at zero: set here, so they really move the choice.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, copy_model, edit_config, make_causal_lm, rewrite_safetensors
from gguf_family_check import (
    assert_full_vocab_recognised,
    assert_refused,
    assert_same_tensors_as_llamacpp,
    check_family,
    check_kquant,
    convert_and_validate,
    convert_only,
    field,
    tensors,
)
from gguf_reader import FastGGUFReader

from pipelines.core.errors import EngineFailed, ModelFormatError
from pipelines.model import streamed_model
from pipelines.targets.gguf import convert as convert_mod

VOCAB = SMALL_BPE_VOCAB
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2)
# multi-head latent attention: 4 heads of 32 + 16 rotary dims, a latent of 32 (real: 128 + 64, 512)
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
           v_head_dim=32)


def yarn(mscale: float, factor: float = 4.0) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": 128,
            "mscale": mscale, "mscale_all_dim": mscale, "beta_fast": 32.0, "beta_slow": 1.0}


# name: (config class, model class, config, gguf arch, router scale, NextN layer appended as released)
CASES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(BASE, **MLA, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=32, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                         norm_topk_prob=True, rope_parameters=yarn(1.0)), "deepseek2", 2.0, True),
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(BASE, **MLA, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=None,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2, topk_method="greedy",
                              norm_topk_prob=False, routed_scaling_factor=1.0, rope_parameters=yarn(0.707)),
                         "deepseek2", 4.0, False),
    # head_dim 32 (not 64 / 4 = 16), half of it rotary, as the released 128 of 5120 / 96; one group (released)
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(BASE, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      attention_bias=True, use_qk_norm=True, first_k_dense_replace=1, n_routed_experts=4,
                      num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                      norm_topk_prob=True), "glm4moe", 2.0, True),
    # built as DeepSeek-V3 with Kimi-K2's features; test_kimi_k2 converts it under Kimi-K2's released config.json
    "kimi_k2_twin": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                     dict(BASE, **MLA, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=32,
                          n_routed_experts=16, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
                          routed_scaling_factor=2.827, norm_topk_prob=True,
                          rope_parameters=yarn(1.0, 32.0)), "deepseek2", 2.0, False),
}
GLM_SPECIAL = {14: "[gMASK]", 15: "<|user|>", 16: "<|observation|>"}  # over <jupyter_output> ... <empty_output>


def _nextn_extras(n: int, hidden: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The tensors a released NextN layer holds besides a decoder layer's."""
    return {f"model.layers.{n}.{k}": s for k, s in (
        ("eh_proj.weight", (hidden, 2 * hidden)), ("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
        ("embed_tokens.weight", (vocab, hidden)), ("shared_head.head.weight", (vocab, hidden)),
        ("shared_head.norm.weight", (hidden,)))}


def _build(name: str, dest: Path, tokenizer_dir: Path) -> Path:
    cfg_cls, model_cls, params, _arch, router_scale, nextn = CASES[name]
    layers = params["num_hidden_layers"]
    # a NextN layer is a whole decoder layer: built as one more layer, then declared NextN
    d = make_causal_lm(cfg_cls, model_cls, dict(params, num_hidden_layers=layers + nextn), dest,
                       tokenizer_dir=tokenizer_dir, router_scale=router_scale)
    rng = np.random.default_rng(1)

    def edit(ts):
        for n in ts:
            if n.endswith("e_score_correction_bias"):
                ts[n] = rng.normal(0.0, 0.3, ts[n].shape).astype(np.float32)
        if nextn:
            for n, shape in _nextn_extras(layers, 64, VOCAB).items():
                ts[n] = (rng.normal(0.0, 0.1, shape) + (len(shape) == 1)).astype(np.float32)

    rewrite_safetensors(d, edit)
    edit_config(d, num_hidden_layers=layers, num_nextn_predict_layers=int(nextn))
    if name == "glm4_moe":
        path = d / "tokenizer.json"
        spec = json.loads(path.read_text(encoding="utf-8"))
        for token in spec["added_tokens"]:
            if token["id"] in GLM_SPECIAL:
                del spec["model"]["vocab"][token["content"]]
                token["content"] = GLM_SPECIAL[token["id"]]
                spec["model"]["vocab"][token["content"]] = token["id"]
        path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-mla-models")

    def build(name: str) -> Path:
        if name not in built:
            built[name] = _build(name, root / name, smollm2_small_vocab_dir)
        return built[name]

    return build


FAMILY_CASES = ["deepseek_v3", "deepseek_v2_lite", "glm4_moe"]


@pytest.mark.parametrize("config_class", sorted({CASES[n][0] for n in FAMILY_CASES}))
def test_full_smollm2_vocabulary_is_recognised(config_class, smollm2_dir, tmp_path):
    """The cut vocabulary's conversions name the pre-tokenizer; the full one needs no name, for each model type."""
    params = next(CASES[n][2] for n in FAMILY_CASES if CASES[n][0] == config_class)
    assert_full_vocab_recognised(config_class, params, smollm2_dir, tmp_path)


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_family_parity(name, model, tmp_path):
    gguf_arch = CASES[name][3]
    d = model(name)
    results = check_family(d, tmp_path, gguf_arch)
    report = results["f16"][0]
    assert report.architecture == CASES[name][1]
    path = tmp_path / f"{d.name}-f16.gguf"
    r, t = FastGGUFReader(str(path)), tensors(path)
    a = gguf_arch
    if a == "deepseek2":
        v3 = name == "deepseek_v3"
        assert field(r, f"{a}.attention.head_count_kv") == 1  # the absorbed form: MQA over the latent
        assert field(r, f"{a}.attention.kv_lora_rank") == 32
        assert field(r, f"{a}.attention.key_length") == 32 + 16 and field(r, f"{a}.attention.value_length") == 32
        assert field(r, f"{a}.attention.key_length_mla") == 48 and field(r, f"{a}.attention.value_length_mla") == 32
        assert field(r, f"{a}.attention.q_lora_rank") == (32 if v3 else 0)  # 0: a plain q_proj at any layer count
        assert field(r, f"{a}.rope.dimension_count") == 16
        assert field(r, f"{a}.leading_dense_block_count") == 1
        assert field(r, f"{a}.expert_shared_count") == (1 if v3 else 2)
        assert field(r, f"{a}.expert_gating_func") == (2 if v3 else 1)  # sigmoid / softmax
        assert field(r, f"{a}.rope.scaling.yarn_log_multiplier") == pytest.approx(0.1 * (1.0 if v3 else 0.707))
        # GGUF shapes read back reversed: attn_k_b [heads, kv_lora, nope] -> (32 nope, 32 latent, 4)
        assert tuple(t["blk.0.attn_k_b.weight"].shape) == (32, 32, 4)
        assert tuple(t["blk.0.attn_v_b.weight"].shape) == (32, 32, 4)
        assert tuple(t["blk.0.attn_kv_a_mqa.weight"].shape) == (64, 32 + 16)
        assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_exps.weight" not in t  # layer 0 dense
        assert "blk.1.ffn_gate_exps.weight" in t and "blk.1.ffn_gate.weight" not in t
        assert tuple(t["blk.1.ffn_down_shexp.weight"].shape) == (32 * (1 if v3 else 2), 64)
        if v3:
            assert tuple(t["blk.0.attn_q_b.weight"].shape) == (32, 4 * 48) and "blk.0.attn_q.weight" not in t
            assert field(r, f"{a}.expert_group_count") == 2 and field(r, f"{a}.expert_group_used_count") == 1
            assert field(r, f"{a}.expert_weights_norm") is True
            assert field(r, f"{a}.expert_weights_scale") == pytest.approx(2.5)
            assert tuple(t["blk.2.exp_probs_b.bias"].shape) == (4,)
            # the NextN layer after the trunk is dropped, as llama.cpp's converter drops it for deepseek2
            assert field(r, f"{a}.block_count") == 3 and not any(n.startswith("blk.3.") for n in t)
        else:
            assert tuple(t["blk.0.attn_q.weight"].shape) == (64, 4 * 48) and "blk.0.attn_q_a.weight" not in t
            assert "blk.1.exp_probs_b.bias" not in t and f"{a}.expert_group_count" not in r.fields
            assert f"{a}.expert_weights_norm" not in r.fields
    else:
        assert field(r, f"{a}.block_count") == 3 and field(r, f"{a}.nextn_predict_layers") == 1
        assert field(r, f"{a}.rope.dimension_count") == 16  # 32 * 0.5
        assert field(r, f"{a}.expert_gating_func") == 2 and field(r, f"{a}.expert_weights_norm") is True
        assert field(r, f"{a}.leading_dense_block_count") == 1 and field(r, f"{a}.expert_shared_count") == 1
        assert "blk.0.attn_q.bias" in t and "blk.0.attn_output.bias" not in t
        assert tuple(t["blk.1.attn_q_norm.weight"].shape) == (32,)
        assert "blk.0.post_attention_norm.weight" in t and "blk.0.ffn_norm.weight" not in t
        # the NextN layer: a MoE decoder layer plus its own tensors
        assert tuple(t["blk.2.nextn.eh_proj.weight"].shape) == (128, 64)
        assert tuple(t["blk.2.nextn.embed_tokens.weight"].shape) == (64, VOCAB)
        for n in ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "nextn.shared_head_head", "ffn_gate_exps",
                  "exp_probs_b", "attn_k_norm"):
            assert any(k.startswith(f"blk.2.{n}.") for k in t), n


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_same_tensors_as_llamacpp(name, model, llamacpp_tree, tmp_path):
    """f16 tensors byte-identical to llama.cpp's converter on the released layout (NextN layer included)."""
    assert_same_tensors_as_llamacpp(llamacpp_tree, model(name), tmp_path)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_q4_k_m(name, model, tmp_path):
    check_kquant(model(name), tmp_path)


def _patched_family(monkeypatch, change) -> None:
    original = convert_mod.family_for
    monkeypatch.setattr(convert_mod, "family_for", lambda arch: change(original(arch)))


def _without_keys(*keys):
    return lambda fam: dataclasses.replace(fam, params=tuple(p for p in fam.params if p.key not in keys))


NEGATIVE = {
    "no_correction_bias": lambda fam: dataclasses.replace(
        fam, tensors=tuple(r for r in fam.tensors if "exp_probs_b" not in r.outputs[0]),
        ignored=fam.ignored + (r".+\.e_score_correction_bias",)),
    "no_expert_groups": _without_keys("{arch}.expert_group_count", "{arch}.expert_group_used_count"),
    # what llama.cpp's converter writes for a config without scoring_func (transformers' DeepseekV3Config has none):
    # no gating key, which llama.cpp's deepseek2 reads as softmax
    "softmax_gating": _without_keys("{arch}.expert_gating_func"),
    "no_yarn_log_multiplier": _without_keys("{arch}.rope.scaling.yarn_log_multiplier"),
}


@pytest.mark.parametrize("change", list(NEGATIVE))
def test_deepseek_v3_routing_and_scale_matter(change, model, tmp_path, monkeypatch):
    """Negative controls: without the correction bias, the expert groups, the sigmoid gating key or the YaRN
    attention scale, the file loads and runs in llama.cpp but computes another model."""
    _patched_family(monkeypatch, NEGATIVE[change])
    _, metrics, _ = convert_and_validate(model("deepseek_v3"), tmp_path / f"deepseek-{change}.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics


def test_glm4_moe_nextn_key_matters(model, tmp_path, monkeypatch):
    """Negative control: without `nextn_predict_layers` llama.cpp takes the NextN layer for a third trunk layer,
    whose NextN tensors it does not expect: the file does not load."""
    _patched_family(monkeypatch, _without_keys("{arch}.nextn_predict_layers"))
    with pytest.raises(EngineFailed, match="wrong number of tensors"):
        convert_and_validate(model("glm4_moe"), tmp_path / "glm-no-nextn-key.gguf", "f16")


def test_glm4_moe_trunk_only_checkpoint(model, tmp_path):
    """A checkpoint without its NextN layer (as transformers' save_pretrained writes it) converts with the same
    keys and no NextN tensors, as llama.cpp's converter writes it, and llama.cpp runs it."""
    d = copy_model(model("glm4_moe"), tmp_path / "glm4_moe")
    rewrite_safetensors(d, lambda ts: [ts.pop(n) for n in [n for n in ts if n.startswith("model.layers.2.")]])
    out = tmp_path / "glm-trunk.gguf"
    _, metrics, _ = convert_and_validate(d, out, "f16")
    r = FastGGUFReader(str(out))
    assert field(r, "glm4moe.block_count") == 3 and field(r, "glm4moe.nextn_predict_layers") == 1
    assert not any(n.startswith("blk.2.") for n in tensors(out))
    assert metrics["mean_kl"] < 1e-3 and metrics["top1_agreement"] >= 0.99, metrics


# Kimi-K2-Instruct's config.json as released (bf16 copies drop only quantization_config), at the tiny sizes
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 1, "eos_token_id": 2,
    "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "kv_lora_rank": 32, "max_position_embeddings": 512, "moe_intermediate_size": 32,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 16, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 4, "num_experts_per_tok": 8, "num_hidden_layers": 2, "num_key_value_heads": 4,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 32, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 128, "type": "yarn"},
    "rope_theta": 10000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3", "use_cache": True, "v_head_dim": 32, "vocab_size": VOCAB,
}


def test_kimi_k2_released_config_is_refused_for_its_yarn_betas(model, tmp_path):
    """Kimi-K2's YaRN says beta_fast = beta_slow = 1; llama.cpp runs 32 / 1 whatever the file says (it does not
    read the yarn_beta keys), which rotates a third of the rotary pairs at other frequencies: refused in one line.
    Measured on the twin built with Kimi's betas at Kimi's rope geometry (64 rotary dims, base 50000, original
    context 4096, factor 32): f16 KL 2.3e-3, top-1 0.89 (5e-7 and 0.999 with 32 / 1)."""
    d = copy_model(model("kimi_k2_twin"), tmp_path / "kimi_k2")
    (d / "config.json").write_text(json.dumps(KIMI_K2))
    with pytest.raises(ModelFormatError, match=r"YaRN beta_fast=1.0 / beta_slow=1.0 is not supported") as err:
        convert_only(d, tmp_path / "refused.gguf")
    assert "\n" not in str(err.value)


def test_kimi_k2_config_converts(model, tmp_path, monkeypatch):
    """Kimi-K2's released config.json (model_type kimi_k2, remote code named, `rope_scaling` of type yarn, 8 of 16
    experts, one group), with the YaRN betas llama.cpp runs, converts and computes its model. Its tokenizer is out
    of scope (tiktoken, remote code; and transformers cannot read a tokenizer beside an unknown model type whose
    rope_scaling it standardizes), so the vocabulary is built from the twin's directory (the same tokenizer
    files). transformers cannot build kimi_k2 either: the file is validated against the same weights under
    DeepSeek-V3's config, which computes the same function."""
    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf.validate import validate_gguf

    twin = model("kimi_k2_twin")
    d = copy_model(twin, tmp_path / "kimi_k2")
    betas = dict(KIMI_K2["rope_scaling"], beta_fast=32.0, beta_slow=1.0)
    (d / "config.json").write_text(json.dumps(dict(KIMI_K2, rope_scaling=betas)))
    build_vocab = convert_mod.build_vocab
    monkeypatch.setattr(convert_mod, "build_vocab", lambda _dir, size, options: build_vocab(twin, size, options))
    out = tmp_path / "kimi-k2-f16.gguf"
    convert_only(d, out)
    monkeypatch.undo()
    r = FastGGUFReader(str(out))
    assert field(r, "deepseek2.expert_used_count") == 8 and field(r, "deepseek2.expert_count") == 16
    assert field(r, "deepseek2.expert_gating_func") == 2
    assert field(r, "deepseek2.expert_weights_scale") == pytest.approx(2.827)
    assert field(r, "deepseek2.rope.scaling.factor") == pytest.approx(32.0)
    assert field(r, "deepseek2.rope.scaling.yarn_log_multiplier") == pytest.approx(0.1)
    metrics, _ = validate_gguf(fetch(str(twin), "test/kimi_k2_twin"), out)
    print(f"kimi_k2 f16: {metrics}")
    assert metrics["token_parity"] == 1.0
    assert metrics["mean_kl"] < 1e-3 and metrics["top1_agreement"] >= 0.99, metrics


def _rope(**change):
    return {"rope_parameters": dict(yarn(1.0), **change)}


FP8 = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                               "weight_block_size": [128, 128]}}
REFUSALS = [
    ("deepseek_v3", FP8, r"config.json has a quantization_config; the GGUF converter reads only unquantized float"),
    ("deepseek_v3", {"attention_bias": True}, r"deepseek2 with attention_bias=true is not supported"),
    ("deepseek_v3", {"rope_interleave": False}, r"deepseek2 with rope_interleave=false is not supported"),
    ("deepseek_v3", _rope(mscale=0.5), r"YaRN mscale=0.5 and mscale_all_dim=1.0 is not supported"),
    ("deepseek_v3", _rope(attention_factor=1.2), r"YaRN attention_factor is not supported"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
     r"rope scaling type 'linear' is not supported for deepseek2"),
    ("deepseek_v3", {"n_shared_experts": 0}, r"deepseek2 GGUF needs n_shared_experts >= 1"),
    ("deepseek_v3", {"num_key_value_heads": 2}, r"deepseek2 GGUF needs num_key_value_heads == num_attention_heads"),
    ("deepseek_v3", {"scoring_func": "softmax"}, r"DeepseekV3ForCausalLM with scoring_func 'softmax'"),
    ("deepseek_v3", {"n_group": 3}, r"4 experts cannot form n_group=3 groups"),
    ("deepseek_v2_lite", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
     r"DeepseekV2 with topk_method group_limited_greedy is not supported"),
    ("deepseek_v2_lite", {"norm_topk_prob": True}, r"deepseek2 with norm_topk_prob=true is not supported"),
    ("deepseek_v2_lite", {"mlp_bias": True}, r"deepseek2 with mlp_bias=true is not supported"),
    ("glm4_moe", {"n_shared_experts": 0}, r"glm4moe GGUF needs n_shared_experts >= 1"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "mrope_section": [2, 3, 3]}}, r"glm4moe GGUF with mrope_section"),
    ("glm4_moe", {"hidden_act": "gelu"}, r"glm4moe with activation 'gelu' is not supported"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
                                      "original_max_position_embeddings": 128, "partial_rotary_factor": 0.5}},
     r"glm4moe GGUF with YaRN beta_fast=8.0 / beta_slow=1.0 is not supported"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_layouts_llama_cpp_cannot_run_are_refused(name, change, message, model, tmp_path):
    assert_refused(model(name), tmp_path, change, message)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_streamed_reference_equals_from_pretrained(name, model):
    """The parity reference (streamed, one block resident; correction biases read from the checkpoint) computes
    what `from_pretrained` does on the released layout, NextN layer and all."""
    import torch

    from pipelines.validation.reference import load_model

    d = model(name)
    ids = list(range(100, 160))
    with streamed_model.StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        got = lm.logits(ids)
    with torch.inference_mode():
        expected = load_model(d)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - expected).max() < 1e-4


def test_router_gaps_see_expert_group_ties(model):
    """A DeepSeek-V3 position's routing gap is the smaller of its group choice's and its expert choice's margins
    (pipelines/validation/router_gaps.py), computed here from the router's own scores."""
    import torch

    from pipelines.validation import router_gaps
    from pipelines.validation.reference import load_model

    hf = load_model(model("deepseek_v3"))
    ids = torch.tensor([list(range(100, 228))])
    with router_gaps.recording(hf) as rec:
        hf(ids)
    got = rec.per_sequence([ids.shape[1]], None)[0]
    expected = np.full(ids.shape[1], np.inf)
    inputs: dict[int, torch.Tensor] = {}
    handles = [layer.mlp.gate.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
               for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        hf(ids)
    for h in handles:
        h.remove()
    for i, x in inputs.items():
        gate = hf.model.layers[i].mlp.gate
        with torch.no_grad():
            s = (torch.sigmoid(x.reshape(-1, 64) @ gate.weight.T) + gate.e_score_correction_bias).numpy()
        spread = s.max(-1) - s.min(-1)
        sums = s.reshape(-1, 2, 2).sum(-1)  # 2 groups of 2: a group's two best are the group
        # top-2 of the chosen group's 2 experts: no tie inside it, only between the groups
        expected = np.minimum(expected, np.abs(sums[:, 0] - sums[:, 1]) / spread)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
