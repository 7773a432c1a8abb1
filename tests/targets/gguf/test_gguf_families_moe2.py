"""GGUF families ERNIE 4.5 MoE, MiniMax-M2 and Apertus on tiny random models: converted to f16 and q8_0 and
validated in llama.cpp against transformers fp32 (`gguf_family_check.check_family`), f16 tensors byte-identical
to llama.cpp's own converter, the streamed direct Q4_K_M, what is special to each family (keys, shapes), a
negative control for the tensor or key that matters in each, and the layouts llama.cpp cannot run (one-line
refusals).

Tokenizers: llama.cpp's converter reads ERNIE's vocabulary only as SentencePiece, so the ERNIE model carries a
SentencePiece model trained here (the reference tokenizes with sentencepiece itself); MiniMax-M2 and Apertus
carry SmolLM2's BPE cut to 2,048 tokens, each conversion naming its pre-tokenizer (`gguf_family_check`).

The MoE models are built as in test_gguf_families_moe.py (weights 0.1, router weights scaled 4x so routing is
decisive, 2x for MiniMax-M2's sigmoid router; both routers are `mlp.gate` in transformers 5, which
`make_causal_lm` scales). Their routing biases (`e_score_correction_bias`) are random, so they really choose:
ERNIE's is a parameter, randomized by `make_causal_lm`; MiniMax-M2's is a buffer (left at zero by it), set
here. Apertus's learned xIELU scalars (alpha_p, alpha_n and the beta buffer) differ per layer, so a key written
for the wrong layer would show.

Released layouts: ERNIE-4.5-*-PT checkpoints add multi-token-prediction tensors (`model.mtp_*`), which both
converters skip (the byte-identity test runs on a copy that has them); MiniMax-M2's per-expert
`block_sparse_moe.experts.{x}.w1/w2/w3` and `block_sparse_moe.e_score_correction_bias` are what transformers 5's
save_pretrained writes too (asserted), so one layout is both.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from factories import copy_model, edit_config, make_causal_lm, make_spm_tokenizer, rewrite_safetensors
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

from pipelines.core.errors import ModelFormatError
from pipelines.model import streamed_model
from pipelines.targets.gguf import convert as convert_mod

BPE_VOCAB = 2048  # SmolLM2's tokenizer cut to 2,048 tokens (gguf_family_check)
SPM_VOCAB = 700
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
# a 256-token original context, so the rope_freqs factors act on the prompts' positions
APERTUS_ROPE = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}

# name: (config class, model class, config, gguf arch, router scale)
CASES = {
    # layer 0 dense (moe_layer_start_index 1), layer 1 MoE with 2 shared experts (one MLP of 2 x 32); tied
    # (transformers' default); intermediate / kv heads = 64 = 2 x 32, so llama.cpp's own shared width is right too
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(TINY, vocab_size=SPM_VOCAB, pad_token_id=0, moe_num_experts=4, moe_k=2,
                          moe_intermediate_size=32, moe_num_shared_experts=2, moe_layer_start_index=1),
                     "ernie4_5-moe", 4.0),
    # head_dim 32 (not 64 / 4 = 16) and rotary_dim 16 (half of it), as the released 128 / 64; 8 experts, 2 used.
    # Router scaled 2x: at 4x most sigmoid scores saturate near 1 and the top-k falls among near-equal ones
    # (measured: f16 KL 2.8e-5 with a flipped position at KL 0.02, against 3e-7 and none at 2x)
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(TINY, vocab_size=BPE_VOCAB, intermediate_size=64, head_dim=32, rotary_dim=16,
                        num_local_experts=8, num_experts_per_tok=2, scoring_func="sigmoid", pad_token_id=None,
                        tie_word_embeddings=False), "minimax-m2", 2.0),
    "apertus": ("ApertusConfig", "ApertusForCausalLM",
                dict(TINY, vocab_size=BPE_VOCAB, initializer_range=0.2, rope_parameters=APERTUS_ROPE,
                     pad_token_id=None), "apertus", 1.0),
}
MTP = {"model.mtp_emb_norm.0.weight": (64,), "model.mtp_hidden_norm.0.weight": (64,),
       "model.mtp_linear_proj.0.weight": (64, 128), "model.mtp_block.0.self_attn.q_proj.weight": (64, 64),
       "model.mtp_block.0.mlp.up_proj.weight": (128, 64)}


def _randomize(name: str, d: Path) -> None:
    """The learned values make_causal_lm leaves at their constructor's constants (see the module docstring)."""
    rng = np.random.default_rng(1)

    def edit(ts):
        for n in ts:
            if name == "minimax_m2" and n.endswith("block_sparse_moe.e_score_correction_bias"):
                ts[n] = rng.normal(0.0, 0.2, ts[n].shape).astype(np.float32)
            elif name == "apertus" and n.endswith(("act_fn.alpha_p", "act_fn.alpha_n", "act_fn.beta")):
                ts[n] = np.asarray(ts[n] + rng.normal(0.0, 0.3, ts[n].shape), dtype=np.float32)  # 0-d: beta

    rewrite_safetensors(d, edit)


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-moe2-models")

    def build(name: str) -> Path:
        if name not in built:
            cfg_cls, model_cls, params, _, router_scale = CASES[name]
            spm = make_spm_tokenizer(root / "spm", vocab_size=SPM_VOCAB) if name == "ernie4_5_moe" else None
            d = make_causal_lm(cfg_cls, model_cls, params, root / name, router_scale=router_scale,
                               tokenizer_dir=spm or smollm2_small_vocab_dir)
            if spm is not None:
                (d / "tokenizer.model").write_bytes((spm / "tokenizer.model").read_bytes())
            _randomize(name, d)
            built[name] = d
        return built[name]

    return build


def _checkpoint(d: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(d / "model.safetensors"))


@pytest.mark.parametrize("config_class", ["MiniMaxM2Config", "ApertusConfig"])
def test_full_smollm2_vocabulary_is_recognised(config_class, smollm2_dir, tmp_path):
    """The cut vocabulary's conversions name the pre-tokenizer; the full one needs no name, for each model type."""
    params = next({k: v for k, v in c[2].items() if v is not None} for c in CASES.values() if c[0] == config_class)
    assert_full_vocab_recognised(config_class, params, smollm2_dir, tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_family_parity(name, model, tmp_path):
    gguf_arch = CASES[name][3]
    d = model(name)
    results = check_family(d, tmp_path, gguf_arch)
    report = results["f16"][0]
    assert report.architecture == CASES[name][1] and report.family == name
    path = tmp_path / f"{d.name}-f16.gguf"
    r = FastGGUFReader(str(path))
    t = tensors(path)
    if name == "ernie4_5_moe":
        assert report.vocab["tokenizer"] == "sentencepiece"
        for key, value in (("expert_count", 4), ("expert_used_count", 2), ("leading_dense_block_count", 1),
                           ("interleave_moe_layer_step", 1), ("expert_feed_forward_length", 32),
                           ("expert_shared_count", 2), ("expert_shared_feed_forward_length", 64),
                           ("feed_forward_length", 128)):
            assert field(r, f"ernie4_5-moe.{key}") == value, key
        # layer 0 dense, layer 1 MoE; GGUF shapes read back reversed: [cols, rows, experts]
        assert tuple(t["blk.0.ffn_gate.weight"].shape) == (64, 128) and "blk.0.ffn_gate_inp.weight" not in t
        assert "blk.1.ffn_gate.weight" not in t
        assert tuple(t["blk.1.ffn_gate_exps.weight"].shape) == (64, 32, 4)
        assert tuple(t["blk.1.ffn_down_exps.weight"].shape) == (32, 64, 4)
        assert tuple(t["blk.1.ffn_up_shexp.weight"].shape) == (64, 64)
        bias = t["blk.1.exp_probs_b.bias"]  # [1, experts] as stored, f32 like every bias
        assert tuple(bias.shape) == (4, 1) and bias.tensor_type == gguf.GGMLQuantizationType.F32
        assert "output.weight" not in t  # tied
    elif name == "minimax_m2":
        assert field(r, "minimax-m2.expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID.value
        assert field(r, "minimax-m2.rope.dimension_count") == 16
        assert field(r, "minimax-m2.attention.key_length") == 32
        assert field(r, "minimax-m2.expert_feed_forward_length") == 64
        assert field(r, "minimax-m2.expert_count") == 8 and field(r, "minimax-m2.expert_used_count") == 2
        # q/k norms over the whole projection: [heads x head_dim], [kv heads x head_dim]
        assert tuple(t["blk.0.attn_q_norm.weight"].shape) == (128,)
        assert tuple(t["blk.0.attn_k_norm.weight"].shape) == (64,)
        assert tuple(t["blk.1.exp_probs_b.bias"].shape) == (8,)
        assert tuple(t["blk.1.ffn_gate_exps.weight"].shape) == (64, 64, 8)
        assert "output.weight" in t
    elif name == "apertus":
        ckpt = _checkpoint(d)
        for key in ("alpha_p", "alpha_n", "beta", "eps"):  # raw per-layer values: llama.cpp applies softplus
            stored = [float(ckpt[f"model.layers.{i}.mlp.act_fn.{key}"].reshape(-1)[0]) for i in range(2)]
            np.testing.assert_allclose(field(r, f"xielu.{key}"), stored, rtol=1e-7)
        assert field(r, "xielu.alpha_p")[0] != field(r, "xielu.alpha_p")[1]
        assert tuple(t["blk.0.attn_q_norm.weight"].shape) == (16,)  # per head
        assert "blk.0.ffn_gate.weight" not in t and tuple(t["blk.1.ffn_up.weight"].shape) == (64, 128)
        assert tuple(t["rope_freqs.weight"].shape) == (8,)


@pytest.mark.parametrize("name", list(CASES))
def test_same_tensors_as_llamacpp(name, model, llamacpp_tree, tmp_path):
    """Byte-identical f16 tensors to llama.cpp's converter; ERNIE on a copy in the released layout (with the
    multi-token-prediction tensors both converters skip)."""
    d = model(name)
    if name == "ernie4_5_moe":
        d = copy_model(d, tmp_path / "ernie-released")
        rng = np.random.default_rng(2)
        rewrite_safetensors(d, lambda ts: ts.update({n: rng.normal(0, 0.1, s).astype(np.float32)
                                                     for n, s in MTP.items()}))
    assert_same_tensors_as_llamacpp(llamacpp_tree, d, tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_q4_k_m(name, model, tmp_path):
    check_kquant(model(name), tmp_path)


def test_minimax_m2_saved_layout_is_the_released_one(model):
    """transformers 5 runs MiniMax-M2's MoE as `mlp.experts.gate_up_proj` but saves the released names."""
    names = set(_checkpoint(model("minimax_m2")))
    for n in ("block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias",
              "block_sparse_moe.experts.7.w1.weight", "block_sparse_moe.experts.0.w2.weight",
              "block_sparse_moe.experts.3.w3.weight"):
        assert f"model.layers.1.{n}" in names
    assert not any(".mlp." in n for n in names)


def _patched_family(monkeypatch, change) -> None:
    original = convert_mod.family_for
    monkeypatch.setattr(convert_mod, "family_for", lambda arch: change(original(arch)))


def _diverges(metrics: dict) -> None:
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics


def test_ernie_routing_bias_matters(model, tmp_path, monkeypatch):
    """Negative control: without `exp_probs_b` (optional in llama.cpp's ernie4_5-moe) the experts are chosen on
    the softmax alone, and diverge from transformers."""
    bias = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_EXP_PROBS_B] + ".bias"
    _patched_family(monkeypatch, lambda fam: dataclasses.replace(
        fam, tensors=tuple(r for r in fam.tensors if r.outputs != (bias,)),
        ignored=fam.ignored + (r".+\.moe_statics\..+",)))
    out = tmp_path / "ernie-no-bias.gguf"
    _, metrics, _ = convert_and_validate(model("ernie4_5_moe"), out, "f16")
    assert "blk.1.exp_probs_b.bias" not in tensors(out)
    _diverges(metrics)


def test_minimax_m2_sigmoid_gating_matters(model, tmp_path, monkeypatch):
    """Negative control: softmax gating (another function llama.cpp offers) instead of the sigmoid loads and
    runs, and diverges."""
    softmax = gguf.ExpertGatingFuncType.SOFTMAX.value
    _patched_family(monkeypatch, lambda fam: dataclasses.replace(fam, params=tuple(
        dataclasses.replace(p, source=lambda hp: softmax) if p.key == gguf.Keys.LLM.EXPERT_GATING_FUNC else p
        for p in fam.params)))
    out = tmp_path / "minimax-softmax.gguf"
    _, metrics, _ = convert_and_validate(model("minimax_m2"), out, "f16")
    assert field(FastGGUFReader(str(out)), "minimax-m2.expert_gating_func") == softmax
    _diverges(metrics)


def test_apertus_xielu_keys_matter(model, tmp_path, monkeypatch):
    """Negative control: alpha_p and alpha_n written to each other's key load and run, and diverge."""
    def swapped(fam):
        (p_key, p_hf), (n_key, n_hf), *rest = fam.tensor_keys
        return dataclasses.replace(fam, tensor_keys=((p_key, n_hf), (n_key, p_hf), *rest))

    _patched_family(monkeypatch, swapped)
    _, metrics, _ = convert_and_validate(model("apertus"), tmp_path / "apertus-swapped.gguf", "f16")
    _diverges(metrics)


REFUSALS = [
    ("ernie4_5_moe", {"moe_layer_interval": 2}, r"ernie4_5-moe with moe_layer_interval=2 is not supported"),
    ("ernie4_5_moe", {"moe_layer_end_index": 0}, r"ernie4_5-moe with moe_layer_end_index=0 is not supported"),
    ("ernie4_5_moe", {"use_bias": True}, r"ernie4_5 with use_bias=true is not supported"),
    ("minimax_m2", {"tie_word_embeddings": True}, r"minimax-m2 with tie_word_embeddings=true is not supported"),
    ("minimax_m2", {"scoring_func": "softmax"}, r"minimax-m2 with scoring_func 'softmax' is not supported"),
    ("apertus", {"hidden_act": "silu"}, r"apertus with activation 'silu' is not supported"),
    ("apertus", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
     r"rope scaling type 'dynamic' is not supported for apertus"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_layouts_llama_cpp_cannot_run_are_refused(name, change, message, model, tmp_path):
    assert_refused(model(name), tmp_path, change, message)


def test_minimax_m2_fp8_release_is_refused(model, tmp_path):
    """MiniMax-M2 is released as FP8 with 128x128 block scales (`weight_scale_inv`): the converter reads only
    float weights, so such a checkpoint is refused in one line (a bf16 copy converts)."""
    d = copy_model(model("minimax_m2"), tmp_path / "minimax")
    edit_config(d, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]})
    with pytest.raises(ModelFormatError, match=r"config.json has a quantization_config") as err:
        convert_only(d, tmp_path / "refused.gguf")
    assert "\n" not in str(err.value)


def test_apertus_missing_xielu_scalar_is_refused(model, tmp_path):
    d = copy_model(model("apertus"), tmp_path / "apertus")
    rewrite_safetensors(d, lambda ts: ts.pop("model.layers.1.mlp.act_fn.beta"))
    with pytest.raises(ModelFormatError, match=r"missing tensor 'model.layers.1.mlp.act_fn.beta' for apertus "
                                               r"\(needed for xielu.beta\)"):
        convert_only(d, tmp_path / "refused.gguf")


@pytest.mark.parametrize("name", ["minimax_m2", "apertus"])
def test_streamed_reference_reads_learned_buffers(name, model, monkeypatch):
    """The parity reference (streamed) computes what `from_pretrained` does, the learned buffers included
    (MiniMax-M2's routing bias, Apertus's xIELU beta): with the constructor's values instead it does not."""
    import torch

    from pipelines.validation.reference import load_model

    d = model(name)
    ids = list(range(100, 160))
    with torch.inference_mode():
        expected = load_model(d)(torch.tensor([ids])).logits[0].numpy()
    with streamed_model.StreamedCausalLM(d, [d / "model.safetensors"]) as lm:
        assert np.abs(lm.logits(ids) - expected).max() < 1e-4
    monkeypatch.setattr(streamed_model.StreamedCausalLM, "_load_buffers", lambda self: None)
    with streamed_model.StreamedCausalLM(d, [d / "model.safetensors"]) as lm:
        assert np.abs(lm.logits(ids) - expected).max() > 1e-2


@pytest.mark.parametrize("name", ["ernie4_5_moe", "minimax_m2"])
def test_imatrix_covers_every_expert(name, model):
    """Per-expert importance rows for the stacked experts of the MoE layers, every token counted top-k times."""
    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix

    d = model(name)
    out = d.parent / f"{name}.imatrix.gguf"
    summary = imatrix.compute(fetch(str(d), f"test/{name}"), out)
    assert summary["missing"] == [], summary
    stored = {t.name: np.asarray(t.data) for t in FastGGUFReader(str(out)).tensors}
    cfg = json.loads((d / "config.json").read_text())
    k, n = cfg.get("moe_k") or cfg["num_experts_per_tok"], cfg.get("moe_num_experts") or cfg["num_local_experts"]
    for tensor in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        counts = stored[f"blk.1.{tensor}.weight.counts"].reshape(-1)
        assert len(counts) == n and counts.sum() == k * summary["tokens"] and counts.min() > 0, (tensor, counts)
