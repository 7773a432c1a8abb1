"""GGUF family Qwen3-Next (Qwen3NextForCausalLM -> llama.cpp `qwen3next`) on a tiny random model in the released
layout: converted, validated in llama.cpp against transformers fp32 on the same token ids, byte-compared with
llama.cpp's own converter, written as a streamed direct Q4_K_M and weighed by an importance matrix.

The model keeps the real config's features at hidden 64: 4 layers, three gated delta-net layers then one gated
full-attention layer (full_attention_interval 4, as released, with no `layer_types` list), more value heads than
key heads in the delta-net (4 / 2, the released 32 / 16), partial rotary 0.25, head_dim set on its own, every
layer MoE (4 experts, top-2, renormalized) with a shared expert and its sigmoid gate, and the released
checkpoint's multi-token-prediction head (`mtp.*`, which neither transformers nor the GGUF runs).

Conditioning, as the MoE tests scale their routers (test_gguf_families_moe.py): a random delta-net is chaotic
where a trained one is not. Its random queries and keys are nearly orthogonal, so a head's read-out of the state
is a sum of terms that cancel, and the gated RMS norm after it (per head, x * w * silu(z)) blows the rounding of
that small sum up: measured on this model as built by transformers, the f16 file's top-1 was 0.988 and q8_0's
KL 0.018 while an f32 file matched at KL 1e-9 (the mapping is right, the model amplifies any rounding). A
trained head's query finds its keys: here each key head's query projection (and its convolution) leans on the
key's, q = (k + 0.5 x q) / |.|, and dt_bias takes Mamba's initialization (dt log-uniform in [0.001, 0.1]) instead
of transformers' dt = softplus(1) ~ 1.3, which with A up to 16 forgets the state after every token.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, copy_model, edit_config, make_causal_lm, rewrite_safetensors
from gguf_family_check import (
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
from pipelines.targets.gguf.families import HParams, family_for, qwen3_next

Q = gguf.GGMLQuantizationType
NK, DK, NV, DV = 2, 16, 4, 16  # delta-net key heads, key head dim, value heads, value head dim
PARAMS = dict(vocab_size=SMALL_BPE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              linear_conv_kernel_dim=4, linear_key_head_dim=DK, linear_value_head_dim=DV, linear_num_key_heads=NK,
              linear_num_value_heads=NV, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
              shared_expert_intermediate_size=96, norm_topk_prob=True, full_attention_interval=4)

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the sizes the memory plan and the keys read)
REAL = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256, intermediate_size=5120,
            linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
            linear_num_value_heads=32, full_attention_interval=4, decoder_sparse_step=1, mlp_only_layers=[],
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            norm_topk_prob=True, partial_rotary_factor=0.25, rope_theta=10000000, rope_scaling=None,
            rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=262144, vocab_size=151936,
            tie_word_embeddings=False, attention_bias=False)


def condition(t: dict[str, np.ndarray]) -> None:
    """Queries that find their keys and Mamba's dt initialization (the module docstring says why)."""
    rng = np.random.default_rng(0)
    for name in list(t):
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            w = t[name].reshape(NK, -1, t[name].shape[-1]).copy()  # per key head: q, k, v group, z group
            w[:, :DK] = (w[:, DK:2 * DK] + 0.5 * w[:, :DK]) / np.sqrt(1.25)
            t[name] = w.reshape(t[name].shape)
        elif name.endswith("linear_attn.conv1d.weight"):  # channels: all q, all k, all v
            c = t[name].copy()
            c[:NK * DK] = c[NK * DK:2 * NK * DK]
            t[name] = c
        elif name.endswith("linear_attn.dt_bias"):
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), t[name].shape))
            t[name] = np.log(np.expm1(dt)).astype(np.float32)  # softplus(dt_bias) = dt


def add_mtp_head(t: dict[str, np.ndarray]) -> None:
    """The released checkpoints' multi-token-prediction head, in their names: a full-attention MoE block
    (`mtp.layers.0.*`) with its input projection and norms."""
    rng = np.random.default_rng(1)
    for name in [n for n in t if n.startswith("model.layers.3.")]:
        t["mtp.layers.0." + name[len("model.layers.3."):]] = t[name].copy()
    t["mtp.fc.weight"] = rng.normal(0, 0.1, (64, 128)).astype(np.float32)
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        t[f"mtp.{norm}.weight"] = rng.normal(0, 0.1, (64,)).astype(np.float32)


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory) -> Path:
    """The tiny Qwen3-Next, its config.json as released (transformers 4's spelling: full_attention_interval,
    partial_rotary_factor and rope_theta at the top, no layer_types)."""
    d = make_causal_lm("Qwen3NextConfig", "Qwen3NextForCausalLM", PARAMS,
                       tmp_path_factory.mktemp("gguf-qwen3next") / "qwen3-next", tokenizer_dir=smollm2_small_vocab_dir,
                       router_scale=4.0)
    rewrite_safetensors(d, lambda t: (condition(t), add_mtp_head(t)))
    edit_config(d, layer_types=None, rope_parameters=None, full_attention_interval=4, partial_rotary_factor=0.25,
                rope_theta=10000000.0)
    return d


def test_qwen3next_parity_keys_and_tensors(model, tmp_path):
    results = check_family(model, tmp_path, "qwen3next")
    assert results["f16"][0].family == "qwen3_next"
    path = tmp_path / f"{model.name}-f16.gguf"
    r, t = FastGGUFReader(str(path)), tensors(path)
    assert field(r, "qwen3next.block_count") == 4  # no MTP block: the released mtp.* tensors are not carried
    assert field(r, "qwen3next.ssm.conv_kernel") == 4 and field(r, "qwen3next.ssm.state_size") == DK
    assert field(r, "qwen3next.ssm.group_count") == NK and field(r, "qwen3next.ssm.time_step_rank") == NV
    assert field(r, "qwen3next.ssm.inner_size") == NV * DV
    assert field(r, "qwen3next.attention.recurrent_layers") == [True, True, True, False]
    assert field(r, "qwen3next.full_attention_interval") == 4
    assert field(r, "qwen3next.rope.dimension_count") == 4  # 16 x 0.25
    assert field(r, "qwen3next.expert_shared_feed_forward_length") == 96
    assert not any(n.startswith("blk.4.") or "nextn" in n for n in t)
    # GGUF shapes read back reversed ([cols, rows]): the query carries its gate, the delta-net's projection is split
    assert tuple(t["blk.3.attn_q.weight"].shape) == (64, 2 * 4 * 16)
    assert tuple(t["blk.0.attn_qkv.weight"].shape) == (64, 2 * NK * DK + NV * DV)
    assert tuple(t["blk.0.attn_gate.weight"].shape) == (64, NV * DV)
    assert tuple(t["blk.0.ssm_ba.weight"].shape) == (64, 2 * NV)
    assert tuple(t["blk.1.ssm_conv1d.weight"].shape) == (4, 2 * NK * DK + NV * DV)
    assert tuple(t["blk.2.ssm_norm.weight"].shape) == (DV,)
    assert tuple(t["blk.0.ffn_gate_inp_shexp.weight"].shape) == (64, 1)  # kept 2-D and f32, as llama.cpp's converter
    assert "blk.3.attn_qkv.weight" not in t and "blk.0.attn_q.weight" not in t
    q8 = tensors(tmp_path / f"{model.name}-q8_0.gguf")
    assert q8["blk.1.ssm_conv1d.weight"].tensor_type == Q.F32 and q8["blk.0.attn_qkv.weight"].tensor_type == Q.Q8_0
    # A = -exp(A_log); the gated norm's weight as stored, the 1 + w norms shifted
    from safetensors.numpy import load_file

    hf = load_file(str(model / "model.safetensors"))
    a_log = hf["model.layers.1.linear_attn.A_log"]
    np.testing.assert_array_equal(np.asarray(t["blk.1.ssm_a"].data), -np.exp(a_log.astype(np.float64)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(t["blk.2.ssm_norm.weight"].data), hf["model.layers.2.linear_attn.norm.weight"])
    np.testing.assert_allclose(np.asarray(t["blk.3.attn_q_norm.weight"].data),
                               hf["model.layers.3.self_attn.q_norm.weight"] + 1, rtol=0, atol=0)


def test_qwen3next_tensors_are_llamacpps(llamacpp_tree, model, tmp_path):
    """Byte for byte what llama.cpp's converter writes with --no-mtp (the head not carried; without it, its default
    run requires one); A = -exp(A_log) within an ulp of torch's float32 exp."""
    assert_same_tensors_as_llamacpp(llamacpp_tree, model, tmp_path, exp_tensors=r"blk\.\d+\.ssm_a",
                                    converter_args=("--no-mtp",))


def test_qwen3next_streamed_q4_k_m(model, tmp_path):
    check_kquant(model, tmp_path)


def test_qwen3next_imatrix_weighs_the_split_projections_and_quantizes(model, tmp_path):
    """The importance matrix covers every matrix llama.cpp quantizes: attn_qkv and attn_gate both from the delta-net's
    input projection (one input, the same sums), ssm_ba, ssm_out, the gated query; a Q4_K_M made with it loads and
    stays within the k-quant bar."""
    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix
    from pipelines.targets.gguf.quantize import quantize
    from pipelines.targets.gguf.validate import validate_gguf

    snap = fetch(str(model), "test/qwen3-next")
    out = tmp_path / "qwen3-next.imatrix.gguf"
    summary = imatrix.compute(snap, out)
    assert summary["missing"] == [], summary
    stored = {t.name: np.asarray(t.data) for t in FastGGUFReader(str(out)).tensors}
    for n in ("blk.0.attn_qkv", "blk.0.attn_gate", "blk.0.ssm_ba", "blk.0.ssm_out", "blk.3.attn_q",
              "blk.2.ffn_down_exps", "blk.1.ffn_up_shexp"):
        assert f"{n}.weight.in_sum2" in stored, n
    np.testing.assert_array_equal(stored["blk.0.attn_qkv.weight.in_sum2"], stored["blk.0.attn_gate.weight.in_sum2"])
    assert stored["blk.0.ssm_out.weight.in_sum2"].size == NV * DV and stored["blk.0.ssm_out.weight.in_sum2"].min() > 0
    f16 = tmp_path / "qwen3-next-f16.gguf"
    convert_only(model, f16)
    q4 = tmp_path / "qwen3-next-imatrix-Q4_K_M.gguf"
    quantize(f16, q4, "Q4_K_M", imatrix=out)
    metrics, _ = validate_gguf(snap, q4)
    print(f"qwen3-next Q4_K_M (imatrix): {metrics}")
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0 and metrics["mean_kl"] <= 0.1, metrics


def _wrong_regroup(w: np.ndarray, hp) -> list[np.ndarray]:
    """The fused projection read as if it were [all q, all k, all v, all z] (no per-key-head regroup)."""
    rows = 2 * NK * DK + NV * DV
    return [np.ascontiguousarray(w[:rows]), np.ascontiguousarray(w[rows:])]


@pytest.mark.parametrize("target,wrong", [("regroup_qkvz", _wrong_regroup),
                                          ("decay_rate", lambda a_log: a_log.astype(np.float32))],
                         ids=["qkvz-not-regrouped", "A_log-as-A"])
def test_qwen3next_transforms_matter(target, wrong, model, tmp_path, monkeypatch):
    """Negative controls: the delta-net's fused projection without its per-head regroup, or A_log written as A,
    load and run in llama.cpp, but parity shows another model."""
    monkeypatch.setattr(qwen3_next, target, wrong)
    _, metrics, _ = convert_and_validate(model, tmp_path / f"qwen3-next-wrong-{target}.gguf", "f16")
    assert metrics["mean_kl"] > 0.05, metrics


def test_transformers5_config_gives_the_same_keys(model):
    """transformers 5 saves layer_types and a rope_parameters dict (partial_rotary_factor inside) instead of the
    released top-level values: the same GGUF keys."""
    released = json.loads((model / "config.json").read_text())
    t5 = {k: v for k, v in released.items() if k not in ("full_attention_interval", "partial_rotary_factor", "rope_theta")}
    t5.update(layer_types=["linear_attention"] * 3 + ["full_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
    family = family_for("Qwen3NextForCausalLM")
    assert family.key_values(HParams(t5)) == family.key_values(HParams(released))
    # no partial_rotary_factor anywhere: Qwen3NextConfig's 0.25
    bare = {k: v for k, v in t5.items() if k != "rope_parameters"}
    assert family.key_values(HParams(bare))["qwen3next.rope.dimension_count"][0] == 4


REFUSALS = [
    ({"mlp_only_layers": [1]}, r"qwen3next GGUF: layers \[1\] are dense"),
    ({"decoder_sparse_step": 2}, r"qwen3next GGUF: layers \[0, 2\] are dense"),
    ({"norm_topk_prob": False}, r"llama.cpp always renormalizes"),
    ({"linear_value_head_dim": 32}, r"linear_key_head_dim 16 != linear_value_head_dim 32"),
    ({"linear_num_value_heads": 3}, r"linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    ({"attention_bias": True}, r"qwen3next with attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, r"qwen3next with activation 'gelu' is not supported"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     r"layer_types must name linear_attention or full_attention"),
]


@pytest.mark.parametrize("change,message", REFUSALS, ids=[next(iter(c)) for c, _ in REFUSALS])
def test_configs_llama_cpp_cannot_run_are_refused_in_one_line(change, message, model):
    cfg = {**json.loads((model / "config.json").read_text()), **change}
    with pytest.raises(ModelFormatError, match=message) as err:
        family_for("Qwen3NextForCausalLM").key_values(HParams(cfg))
    assert "\n" not in str(err.value)


def test_a_refused_checkpoint_leaves_no_file(model, tmp_path):
    d = copy_model(model, tmp_path / "dense-layer")
    edit_config(d, mlp_only_layers=[0])
    out = tmp_path / "refused.gguf"
    with pytest.raises(ModelFormatError, match=r"layers \[0\] are dense"):
        convert_only(d, out)
    assert not out.exists()


def test_the_memory_plan_counts_the_delta_net_state_and_attention_layers_only():
    """Qwen3-Next-80B-A3B: a KV cache in its 12 full-attention layers, and per sequence in each of its 36 delta-net
    layers 3 x (2 x 16 x 128 + 32 x 128) convolution values + 32 x 128 x 128 delta-rule values, f32 (llama.cpp's
    n_embd_r + n_embd_s): 2.09 MiB a layer, 75.4 MiB in all."""
    from pipelines.targets.gguf.plan import recurrent_cache

    per_layer = 3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128
    assert qwen3_next.recurrent_state_values(HParams(REAL)) == per_layer == 548_864
    assert recurrent_cache(REAL) == (12, 36 * per_layer)
    assert 36 * per_layer * 4 / 2**20 == pytest.approx(75.375)
