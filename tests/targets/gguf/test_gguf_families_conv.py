"""GGUF families with recurrent state beside attention: LFM2 and LFM2-MoE (short convolutions) and Falcon-H1 (a
Mamba-2 mixer in parallel with attention in every layer), on tiny random models: f16 and q8_0 validated in
llama.cpp against transformers fp32 on the same token ids (`gguf_family_check.check_family`: all positions'
logits in one batch after the recurrent state is cleared, then greedy decoding token by token, which carries it),
f16 tensors as llama.cpp's own converter writes them, the streamed direct Q4_K_M, the importance matrix, the
recurrent state the memory plan counts, a negative control per family and the layouts llama.cpp cannot run
(one-line refusals).

LFM2's model has every block kind (conv, attention, conv, attention) and is saved with the released config's
spelling (`block_ff_dim`, `full_attn_idxs`, `tie_embedding`, a top-level `rope_theta`), which transformers reads
as its own; its MLP width is two thirds of block_ff_dim rounded up to block_multiple_of (192 from 256 here).
LFM2-MoE's has a dense layer then MoE ones, its experts per expert (`feed_forward.experts.N.w1`) as released and as
transformers 5 saves them, routers scaled 4x by hand (weights 0.1, as in test_gguf_families_moe.py) and a random
routing bias. Falcon-H1's has the 34B's mixer features (2 groups, the gated RMS norm after the gate) and every µP
multiplier set to a distinct value, with A_log and D randomized (transformers initializes them to log(1..n), 1).
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
    tensors,
)
from gguf_reader import FastGGUFReader

from pipelines.targets.gguf import convert as convert_mod
from pipelines.targets.gguf.families import BY_ARCHITECTURE
from pipelines.targets.gguf.families.spec import IDENTITY, HParams, Transform, accept

VOCAB = SMALL_BPE_VOCAB  # SmolLM2's tokenizer cut to 2,048 tokens (gguf_family_check)
LFM2_TYPES = ["conv", "full_attention", "conv", "full_attention"]
MULTIPLIERS = dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=0.8,
                   attention_out_multiplier=0.9, key_multiplier=0.7, ssm_in_multiplier=1.25, ssm_out_multiplier=0.6,
                   mlp_multipliers=[0.9, 0.6], ssm_multipliers=[0.35, 0.25, 0.5, 0.7, 0.4])

# name: (config class, model class, config, gguf arch)
CASES = {
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, norm_eps=1e-5,
                  layer_types=LFM2_TYPES, conv_L_cache=3, block_multiple_of=64, block_ffn_dim_multiplier=1.0,
                  block_auto_adjust_ff_dim=True, bos_token_id=1, eos_token_id=2, pad_token_id=0), "lfm2"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       initializer_range=0.2, rope_theta=10000.0, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16,
                       mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=True,
                       mamba_norm_before_gate=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       **MULTIPLIERS), "falcon-h1"),
    # one dense layer, then MoE (conv, attention, conv): weights 0.1, routers scaled 4x by hand (not `mlp.gate`)
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM",
                 dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.1, norm_eps=1e-5, layer_types=LFM2_TYPES, conv_L_cache=3,
                      num_dense_layers=1, num_experts=4, num_experts_per_tok=2, use_expert_bias=True,
                      norm_topk_prob=True, routed_scaling_factor=1.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                 "lfm2moe"),
}
LFM2_FFN = 192  # int(2 * 256 / 3) = 170, rounded up to a multiple of 64


def _released_lfm2_config(d: Path) -> None:
    """The config as LiquidAI released LFM2-1.2B's: transformers 4 spellings, no layer_types, no lm_head."""
    cfg = json.loads((d / "config.json").read_text())
    edit_config(d, layer_types=None, intermediate_size=None, tie_word_embeddings=None, rope_parameters=None,
                full_attn_idxs=[i for i, t in enumerate(LFM2_TYPES) if t == "full_attention"],
                block_ff_dim=cfg["intermediate_size"], tie_embedding=True,
                rope_theta=cfg["rope_parameters"]["rope_theta"])


def _decisive_router(d: Path) -> None:
    """LFM2-MoE's router weights scaled 4x, and its routing bias (a buffer transformers leaves at 0) randomized."""
    rng = np.random.default_rng(0)

    def edit(ts):
        for n in ts:
            if n.endswith("feed_forward.gate.weight"):
                ts[n] = ts[n] * np.float32(4.0)
            elif n.endswith("feed_forward.expert_bias"):
                ts[n] = rng.normal(0.0, 0.5, ts[n].shape).astype(np.float32)
    rewrite_safetensors(d, edit)


def _randomize_mixer(d: Path) -> None:
    """Falcon-H1's A_log and D as a trained model has them, not transformers' log(1..n) and ones."""
    rng = np.random.default_rng(0)

    def edit(ts):
        for n in ts:
            if n.endswith("mamba.A_log"):
                ts[n] = np.log(rng.uniform(0.5, 8.0, ts[n].shape)).astype(np.float32)
            elif n.endswith("mamba.D"):
                ts[n] = rng.normal(1.0, 0.5, ts[n].shape).astype(np.float32)
    rewrite_safetensors(d, edit)


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-conv-models")

    def build(name: str) -> Path:
        if name not in built:
            cfg_cls, model_cls, params, _ = CASES[name]
            d = make_causal_lm(cfg_cls, model_cls, params, root / name, tokenizer_dir=smollm2_small_vocab_dir)
            if name == "lfm2":
                _released_lfm2_config(d)
            elif name == "lfm2_moe":
                _decisive_router(d)
            else:
                _randomize_mixer(d)
            built[name] = d
        return built[name]

    return build


def _fields(path: Path) -> dict:
    r = FastGGUFReader(str(path))
    return {k: r.fields[k].contents() for k in r.fields if not k.startswith(("tokenizer.", "general."))}


@pytest.mark.parametrize("name", list(CASES))
def test_family_parity(name, model, tmp_path):
    gguf_arch = CASES[name][3]
    d = model(name)
    results = check_family(d, tmp_path, gguf_arch)
    report = results["f16"][0]
    assert report.family == name
    path = tmp_path / f"{d.name}-f16.gguf"
    keys, t = _fields(path), tensors(path)
    if name == "lfm2":
        assert keys["lfm2.attention.head_count_kv"] == [0, 2, 0, 2]  # 0: a convolution layer (recurrent)
        assert keys["lfm2.feed_forward_length"] == LFM2_FFN
        assert keys["lfm2.shortconv.l_cache"] == 3
        assert keys["lfm2.rope.freq_base"] == pytest.approx(1e6)
        # GGUF shapes read back reversed: the kernel [hidden, L] is (L, hidden)
        assert tuple(t["blk.0.shortconv.conv.weight"].shape) == (3, 64)
        assert t["blk.0.shortconv.conv.weight"].tensor_type.name == "F32"
        assert tuple(t["blk.0.shortconv.in_proj.weight"].shape) == (64, 192)
        assert tuple(t["blk.1.ffn_gate.weight"].shape) == (64, LFM2_FFN)
        assert tuple(t["blk.1.attn_q_norm.weight"].shape) == (16,)
        assert "blk.0.attn_q.weight" not in t and "blk.1.shortconv.in_proj.weight" not in t
        assert "token_embd_norm.weight" in t and "output.weight" not in t  # tied: token_embd is the output
    elif name == "lfm2_moe":
        assert keys["lfm2moe.attention.head_count_kv"] == [0, 2, 0, 2]
        assert keys["lfm2moe.expert_gating_func"] == 2  # sigmoid
        assert keys["lfm2moe.leading_dense_block_count"] == 1
        assert keys["lfm2moe.expert_feed_forward_length"] == 64 and keys["lfm2moe.feed_forward_length"] == 128
        assert keys["lfm2moe.expert_count"] == 4 and keys["lfm2moe.expert_used_count"] == 2
        assert tuple(t["blk.0.ffn_gate.weight"].shape) == (64, 128) and "blk.0.ffn_gate_inp.weight" not in t
        assert tuple(t["blk.1.ffn_gate_exps.weight"].shape) == (64, 64, 4)
        assert tuple(t["blk.3.ffn_down_exps.weight"].shape) == (64, 64, 4)
        assert tuple(t["blk.2.exp_probs_b.bias"].shape) == (4,)
        assert t["blk.2.ffn_gate_inp.weight"].tensor_type.name == "F32"
    else:
        assert keys["falcon-h1.ssm.inner_size"] == 96 and keys["falcon-h1.ssm.group_count"] == 2
        assert keys["falcon-h1.ssm.time_step_rank"] == 6 and keys["falcon-h1.ssm.state_size"] == 16
        assert keys["falcon-h1.ssm.conv_kernel"] == 4
        assert keys["falcon-h1.attention.key_length"] == 16
        assert tuple(t["blk.0.ssm_in.weight"].shape) == (64, 2 * 96 + 2 * 2 * 16 + 6)
        assert tuple(t["blk.0.ssm_conv1d.weight"].shape) == (4, 96 + 2 * 2 * 16)
        assert tuple(t["blk.1.ssm_a"].shape) == (1, 6) and t["blk.1.ssm_a"].tensor_type.name == "F32"
        assert tuple(t["blk.1.ssm_norm.weight"].shape) == (48, 2)
        assert "blk.0.ffn_norm" in t  # llama.cpp's falcon-h1 names it without `.weight`
        # A = -exp(A_log), correctly rounded (exp in float64)
        from safetensors.numpy import load_file

        a_log = load_file(str(d / "model.safetensors"))["model.layers.1.mamba.A_log"]
        np.testing.assert_array_equal(np.asarray(t["blk.1.ssm_a"].data).reshape(-1),
                                      (-np.exp(a_log.astype(np.float64))).astype(np.float32))


@pytest.mark.parametrize("name", list(CASES))
def test_same_tensors_as_llama_cpp(name, model, llamacpp_tree, tmp_path):
    # Falcon-H1's A = -exp(A_log): within an ulp of llama.cpp's torch float32 exp (gguf_family_check)
    assert_same_tensors_as_llamacpp(llamacpp_tree, model(name), tmp_path,
                                    exp_tensors=r"blk\.\d+\.ssm_a" if name == "falcon_h1" else None)


@pytest.mark.parametrize("name", list(CASES))
def test_direct_q4_k_m(name, model, tmp_path):
    check_kquant(model(name), tmp_path)


def _patched_family(monkeypatch, change) -> None:
    original = convert_mod.family_for
    monkeypatch.setattr(convert_mod, "family_for", lambda arch: change(original(arch)))


def _replace_rule(fam, output: str, transform: Transform):
    rules = tuple(dataclasses.replace(r, transform=transform) if r.outputs == (output,) else r for r in fam.tensors)
    assert rules != fam.tensors
    return dataclasses.replace(fam, tensors=rules)


def test_lfm2_convolution_direction_matters(model, tmp_path, monkeypatch):
    """Negative control: each channel's kernel written in reverse time order loads and runs, and diverges (the
    short convolutions are what parity measures, not only the attention layers)."""
    reverse = Transform("reversed_conv", lambda xs, hp: [np.ascontiguousarray(xs[0].reshape(xs[0].shape[0], -1)[:, ::-1])],
                        lambda s, hp: [(s[0][0], s[0][-1])])
    _patched_family(monkeypatch, lambda fam: _replace_rule(fam, "blk.{bid}.shortconv.conv.weight", reverse))
    _, metrics, _ = convert_and_validate(model("lfm2"), tmp_path / "lfm2-reversed.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics


def test_lfm2_moe_routing_bias_matters(model, tmp_path, monkeypatch):
    """Negative control: the routing bias written as zeros (transformers' constructor value, what a reference that
    did not load the buffer would use) loads and runs, and routes other tokens elsewhere."""
    zeros = Transform("zeros", lambda xs, hp: [np.zeros_like(xs[0])], lambda s, hp: [s[0]])
    _patched_family(monkeypatch, lambda fam: _replace_rule(fam, "blk.{bid}.exp_probs_b.bias", zeros))
    _, metrics, _ = convert_and_validate(model("lfm2_moe"), tmp_path / "lfm2-moe-no-bias.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics


def test_falcon_h1_mup_vector_matters(model, tmp_path, monkeypatch):
    """Negative control: in_proj without its µP factors (ssm_in_multiplier and the z/x/B/C/dt ssm_multipliers)
    loads and runs, and diverges."""
    _patched_family(monkeypatch, lambda fam: _replace_rule(fam, "blk.{bid}.ssm_in.weight", IDENTITY))
    _, metrics, _ = convert_and_validate(model("falcon_h1"), tmp_path / "falcon-h1-no-mup.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics


def test_falcon_h1_norm_before_gate_is_rightly_refused(model, tmp_path, monkeypatch):
    """Negative control for a refusal: mamba_norm_before_gate=true converted anyway (its check bypassed) runs in
    llama.cpp, which gates first, and diverges from transformers."""
    d = copy_model(model("falcon_h1"), tmp_path / "falcon_h1")
    edit_config(d, mamba_norm_before_gate=True)
    _patched_family(monkeypatch, lambda fam: dataclasses.replace(fam, check=accept))
    _, metrics, _ = convert_and_validate(d, tmp_path / "falcon-h1-norm-first.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics


def test_lfm2_config_spellings_agree(model, tmp_path):
    """transformers 5's spelling of the same model (layer_types, intermediate_size, tie_word_embeddings,
    rope_parameters) converts to the same keys and tensors as the released one; without a rope base the rope
    is transformers' LFM2 default, 1e6."""
    released = tmp_path / "released.gguf"
    convert_only(model("lfm2"), released)
    d = copy_model(model("lfm2"), tmp_path / "lfm2")
    edit_config(d, full_attn_idxs=None, block_ff_dim=None, tie_embedding=None, rope_theta=None,
                layer_types=LFM2_TYPES, intermediate_size=256, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    saved = tmp_path / "saved.gguf"
    convert_only(d, saved)
    assert _fields(saved) == _fields(released)
    assert {n: np.asarray(x.data).tobytes() for n, x in tensors(saved).items()} == \
        {n: np.asarray(x.data).tobytes() for n, x in tensors(released).items()}
    edit_config(d, rope_parameters=None)
    convert_only(d, saved)
    assert _fields(saved)["lfm2.rope.freq_base"] == pytest.approx(1e6)


REFUSALS = [
    ("lfm2", {"conv_bias": True}, r"lfm2 with conv_bias=true is not supported"),
    ("lfm2", {"conv_L_cache": 1}, r"lfm2 with conv_L_cache=1 is not supported"),
    ("lfm2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"rope scaling type 'linear' is not supported for lfm2"),
    ("lfm2", {"full_attn_idxs": None, "layer_types": ["conv", "mamba", "conv", "conv"]},
     r"layer_types must name conv or full_attention"),
    ("lfm2", {"head_dim": 32}, r"lfm2 GGUF needs num_attention_heads x head_dim == hidden_size"),
    ("lfm2_moe", {"norm_topk_prob": False}, r"lfm2moe with norm_topk_prob=false is not supported"),
    ("lfm2_moe", {"use_expert_bias": False}, r"lfm2moe with use_expert_bias=false is not supported"),
    ("lfm2_moe", {"routed_scaling_factor": 2.5}, r"lfm2moe with routed_scaling_factor=2.5 is not supported"),
    ("lfm2_moe", {"conv_bias": True}, r"lfm2moe with conv_bias=true is not supported"),
    ("falcon_h1", {"mamba_norm_before_gate": True}, r"falcon-h1 with mamba_rms_norm and mamba_norm_before_gate=true"),
    ("falcon_h1", {"attention_bias": True}, r"falcon-h1 with attention_bias=true is not supported"),
    ("falcon_h1", {"mamba_proj_bias": True}, r"falcon-h1 with mamba_proj_bias=true is not supported"),
    ("falcon_h1", {"mamba_conv_bias": False}, r"falcon-h1 with mamba_conv_bias=false is not supported"),
    ("falcon_h1", {"time_step_limit": [0.0, 10.0]}, r"falcon-h1 with time_step_limit=\[0.0, 10.0\] is not supported"),
    ("falcon_h1", {"tie_word_embeddings": True}, r"falcon-h1 with tied embeddings and embedding_multiplier 2.0 != "
                                                 r"lm_head_multiplier 0.5"),
    ("falcon_h1", {"hidden_act": "gelu"}, r"falcon-h1 with activation 'gelu' is not supported"),
    ("falcon_h1", {"ssm_multipliers": [1.0, 1.0]}, r"falcon-h1 config ssm_multipliers must be a list of 5 numbers"),
    ("falcon_h1", {"mamba_n_heads": 5}, r"falcon-h1 GGUF: 5 Mamba heads must split the inner size 96"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_layouts_llama_cpp_cannot_run_are_refused(name, change, message, model, tmp_path):
    assert_refused(model(name), tmp_path, change, message)


def test_default_time_step_limit_as_transformers_saves_it(model, tmp_path):
    """transformers 5 writes the default dt limit (0, inf) as [0.0, {"__float__": "Infinity"}]: not a clamp."""
    d = model("falcon_h1")
    assert json.loads((d / "config.json").read_text())["time_step_limit"][1] == {"__float__": "Infinity"}
    edit_config(copy_model(d, tmp_path / "fh"), time_step_limit=[0.0, float("inf")])
    convert_only(tmp_path / "fh", tmp_path / "inf.gguf")


@pytest.mark.parametrize("name", list(CASES))
def test_imatrix_covers_every_quantized_matrix(name, model):
    """The importance matrix has every matrix libllama quantizes (the convolution kernels and A are kept f32 and
    have none, as in llama.cpp's own imatrix), each counted over every calibration token."""
    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix

    d = model(name)
    out = d.parent / f"{name}.imatrix.gguf"
    summary = imatrix.compute(fetch(str(d), f"test/{name}"), out)
    assert summary["missing"] == [], summary
    stored = {t.name: np.asarray(t.data) for t in FastGGUFReader(str(out)).tensors}
    wanted = {"lfm2": ["blk.0.shortconv.in_proj.weight", "blk.2.shortconv.out_proj.weight", "blk.1.attn_q.weight"],
              "lfm2_moe": ["blk.2.shortconv.in_proj.weight", "blk.3.attn_output.weight"],
              "falcon_h1": ["blk.0.ssm_in.weight", "blk.1.ssm_out.weight", "blk.1.attn_k.weight"]}[name]
    for n in wanted + ["blk.0.ffn_down.weight"]:
        assert stored[f"{n}.counts"].reshape(-1).tolist() == [summary["tokens"]], n
    assert not any("conv1d" in n or "shortconv.conv" in n or "ssm_a" in n for n in stored)
    if name == "lfm2_moe":  # every expert reached, each token counted top-k times
        counts = stored["blk.1.ffn_down_exps.weight.counts"].reshape(-1)
        assert len(counts) == 4 and counts.sum() == 2 * summary["tokens"] and counts.min() > 0, counts


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_reference_equals_from_pretrained(name, model):
    """The parity reference (streamed, one block resident; LFM2-MoE's routing bias read as the buffer it is)
    computes what `from_pretrained` does."""
    import torch

    from pipelines.model import streamed_model
    from pipelines.validation.reference import load_model

    d = model(name)
    ids = list(range(100, 160))
    with streamed_model.StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        got = lm.logits(ids)
    with torch.inference_mode():
        expected = load_model(d)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - expected).max() < 1e-4


@pytest.mark.parametrize("config_class", sorted({case[0] for case in CASES.values()}))
def test_full_smollm2_vocabulary_is_recognised(config_class, smollm2_dir, tmp_path):
    """The cut vocabulary's conversions name the pre-tokenizer; the full one needs no name, for each model type."""
    params = next(case[2] for case in CASES.values() if case[0] == config_class)
    assert_full_vocab_recognised(config_class, params, smollm2_dir, tmp_path)


# The released configs (LiquidAI/LFM2-1.2B, tiiuae/Falcon-H1-34B-Instruct): what the memory plan counts per sequence
LFM2_1_2B = dict(architectures=["Lfm2ForCausalLM"], hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, conv_L_cache=3, block_ff_dim=12288, vocab_size=65536,
                 full_attn_idxs=[2, 5, 8, 10, 12, 14])
FALCON_H1_34B = dict(architectures=["FalconH1ForCausalLM"], hidden_size=5120, num_hidden_layers=72,
                     num_attention_heads=20, num_key_value_heads=4, head_dim=128, mamba_d_conv=4, mamba_d_ssm=4096,
                     mamba_d_head=128, mamba_n_heads=32, mamba_n_groups=2, mamba_d_state=256, vocab_size=261120)


def test_recurrent_state_of_the_released_sizes():
    """llama.cpp's per-sequence state (f32), as the memory plan's validation step counts it beside the KV cache of
    the layers that have one: LFM2's (L - 1) x hidden per convolution layer (KV in its 6 attention layers of 16);
    Falcon-H1's (d_conv - 1) x (d_ssm + 2 x groups x d_state) + d_state x d_ssm in every layer (KV in every layer)."""
    from pipelines.targets.gguf.plan import recurrent_cache

    lfm2, falcon = BY_ARCHITECTURE["Lfm2ForCausalLM"], BY_ARCHITECTURE["FalconH1ForCausalLM"]
    assert lfm2.recurrent_state(HParams(LFM2_1_2B)) == 10 * 2 * 2048  # 160 KiB
    assert recurrent_cache(LFM2_1_2B) == (6, 40_960)
    per_layer = 3 * (4096 + 2 * 2 * 256) + 256 * 4096  # 4.06 MiB
    assert falcon.recurrent_state(HParams(FALCON_H1_34B)) == 72 * per_layer == 76_603_392  # 292 MiB
    assert recurrent_cache(FALCON_H1_34B) == (None, 76_603_392)
