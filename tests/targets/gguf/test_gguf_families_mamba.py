"""GGUF families of Mamba-2 hybrids: Granite 4 (GraniteMoeHybrid -> `granitehybrid`, or `granite` without Mamba
layers) and Nemotron-H (-> `nemotron_h`), on tiny random models with every layer type, validated in llama.cpp
(which runs them with recurrent state) against transformers fp32 on the same token ids as every family.

The models keep the released layouts: Granite 4.0-H's `layer_types` spelled "mamba" / "attention" (transformers
5 saves "linear_attention" / "full_attention", and llama.cpp's converter finds no attention layer in that
spelling), its routed experts stacked JetMoE style beside a shared MLP, tied embeddings, no positions ("nope");
Nemotron-H's `backbone.*` names and its `hybrid_override_pattern` with a dense config (transformers 5 writes MoE
defaults and `layers_block_type` into every config it saves: rewritten here as released). Both mixers use 8 heads
of 16 in 2 groups of d_state 16, so the grouped gated norm and the head-to-group mapping are exercised.

For each: f16 / q8_0 parity (`check_family`), f16 tensors as llama.cpp's converter writes them (A = -exp(A_log)
within one ulp: `assert_same_tensors_as_llamacpp(exp_tensors=...)`), the streamed direct Q4_K_M, the
importance matrix of the Mamba projections, the recurrent state the memory plan counts, a negative control
(A_log written as is), and one-line refusals. A_log and D are drawn at random per head; the Granite MoE router is
scaled 4x by hand (`router.layer`), as in test_gguf_families_wide.py, so routing is decisive.
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

from pipelines.model import streamed_model
from pipelines.targets.gguf import convert as convert_mod
from pipelines.targets.gguf.families import HParams, family_for
from pipelines.targets.gguf.families.shared import Mamba2

VOCAB = SMALL_BPE_VOCAB
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2)
GRANITE = dict(BASE, intermediate_size=32, shared_intermediate_size=96, num_hidden_layers=4, tie_word_embeddings=True,
               num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
               mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, embedding_multiplier=4.0, residual_multiplier=0.5,
               attention_multiplier=0.1, logits_scaling=2.0, position_embedding_type="nope",
               layer_types=["mamba", "attention", "mamba", "attention"])
NEMOTRON = dict(BASE, intermediate_size=128, hybrid_override_pattern="M-*-", head_dim=16, tie_word_embeddings=False,
                mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2,
                chunk_size=16, layer_norm_epsilon=1e-5)
# keys transformers 5 adds to every NemotronHConfig it saves; Nemotron-Nano-9B-v2 (dense) has none of them
NEMOTRON_MOE_DEFAULTS = ("moe_intermediate_size", "moe_latent_size", "moe_shared_expert_intermediate_size",
                         "moe_shared_expert_overlap", "mtp_layers_block_type", "n_group", "n_routed_experts",
                         "n_shared_experts", "norm_topk_prob", "num_experts_per_tok", "num_nextn_predict_layers",
                         "routed_scaling_factor", "topk_group", "output_router_logits")
# name: (config class, model class, config, gguf arch)
CASES = {
    "granite4_h": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE, "granitehybrid"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON, "nemotron_h"),
}
EXP_TENSORS = r"blk\.\d+\.ssm_a"  # A = -exp(A_log): within an ulp of llama.cpp's (gguf_family_check)


def as_released(name: str, d: Path) -> None:
    """The config as the Hub's releases spell it (see the module docstring)."""
    if name.startswith("granite4"):
        kinds = {"linear_attention": "mamba", "full_attention": "attention"}
        cfg = json.loads((d / "config.json").read_text())
        edit_config(d, layer_types=[kinds.get(t, t) for t in cfg["layer_types"]])
    else:
        cfg = json.loads((d / "config.json").read_text())
        letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
        pattern = "".join(letters[t] for t in cfg["layers_block_type"])
        edit_config(d, layers_block_type=None, hybrid_override_pattern=pattern, num_hidden_layers=len(pattern),
                    **{k: None for k in NEMOTRON_MOE_DEFAULTS})


def _randomize(d: Path, router_scale: float) -> None:
    """Per-head A_log and D drawn at random (transformers initializes A_log = log(1..heads) and D = 1, which would
    hide a misplaced D), and the Granite MoE router scaled."""
    rng = np.random.default_rng(0)

    def edit(ts):
        for n in ts:
            if n.endswith(".A_log"):
                ts[n] = (ts[n] + rng.normal(0.0, 0.3, ts[n].shape)).astype(np.float32)
            elif n.endswith(".D"):
                ts[n] = rng.normal(1.0, 0.5, ts[n].shape).astype(np.float32)
            elif n.endswith("block_sparse_moe.router.layer.weight"):
                ts[n] = ts[n] * np.float32(router_scale)
    rewrite_safetensors(d, edit)


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) a tiny model: a case of CASES, or a variant (name, config changes)."""
    built: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("gguf-mamba-models")

    def build(name: str, variant: str = "", **changes) -> Path:
        key = (name, variant)
        if key not in built:
            cfg_cls, model_cls, params, _ = CASES[name]
            d = make_causal_lm(cfg_cls, model_cls, {**params, **changes}, root / f"{name}{variant}",
                               tokenizer_dir=smollm2_small_vocab_dir)
            as_released(name, d)
            _randomize(d, router_scale=4.0)
            built[key] = d
        return built[key]

    return build


FULL_VOCAB_CASES = {case[0]: case[2] for case in CASES.values()}


@pytest.mark.parametrize("config_class", sorted(FULL_VOCAB_CASES))
def test_full_smollm2_vocabulary_is_recognised(config_class, smollm2_dir, tmp_path):
    params = {k: v for k, v in FULL_VOCAB_CASES[config_class].items() if v is not None}
    assert_full_vocab_recognised(config_class, params, smollm2_dir, tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_family_parity(name, model, tmp_path):
    d = model(name)
    arch = CASES[name][3]
    results = check_family(d, tmp_path, arch)
    path = tmp_path / f"{d.name}-f16.gguf"
    r, t = FastGGUFReader(str(path)), tensors(path)
    # llama.cpp's Mamba-2: head count as time_step_rank, inner size, groups; a layer is recurrent when its
    # head_count_kv entry is 0 (nemotron_h: and its feed_forward_length entry)
    assert field(r, f"{arch}.ssm.time_step_rank") == 8 and field(r, f"{arch}.ssm.inner_size") == 128
    assert field(r, f"{arch}.ssm.group_count") == 2 and field(r, f"{arch}.ssm.state_size") == 16
    assert field(r, f"{arch}.ssm.conv_kernel") == 4 and field(r, f"{arch}.context_length") == 2**20
    # GGUF shapes read back reversed: ssm_a [heads, 1] -> (1, 8); the norm [groups, 64] -> (64, 2)
    assert tuple(t["blk.0.ssm_a"].shape) == (1, 8) and tuple(t["blk.0.ssm_d"].shape) == (1, 8)
    assert tuple(t["blk.0.ssm_conv1d.weight"].shape) == (4, 128 + 2 * 2 * 16)
    assert tuple(t["blk.0.ssm_norm.weight"].shape) == (64, 2)
    assert tuple(t["blk.0.ssm_in.weight"].shape) == (64, 2 * 128 + 2 * 2 * 16 + 8)
    assert np.all(np.asarray(t["blk.0.ssm_a"].data) < 0)  # A = -exp(A_log)
    q8 = tensors(tmp_path / f"{d.name}-q8_0.gguf")
    assert all(q8[f"blk.0.{n}"].tensor_type.name == "F32" for n in ("ssm_a", "ssm_d", "ssm_conv1d.weight"))
    assert q8["blk.0.ssm_in.weight"].tensor_type.name == "Q8_0"
    if name == "granite4_h":
        assert results["f16"][0].family == "granitehybrid"
        assert field(r, "granitehybrid.attention.head_count_kv") == [0, 2, 0, 2]
        assert field(r, "granitehybrid.rope.scaling.finetuned") is False  # no positions
        assert field(r, "granitehybrid.expert_shared_feed_forward_length") == 96
        assert tuple(t["blk.0.ffn_gate_exps.weight"].shape) == (64, 32, 4)
        assert tuple(t["blk.1.ffn_up_shexp.weight"].shape) == (64, 96)
        assert "blk.0.attn_q.weight" not in t and "blk.1.ssm_in.weight" not in t
        assert "output.weight" not in t  # tied
    else:
        assert field(r, "nemotron_h.attention.head_count_kv") == [0, 0, 2, 0]
        assert field(r, "nemotron_h.feed_forward_length") == [0, 128, 0, 128]
        assert field(r, "nemotron_h.attention.key_length") == 16
        assert "nemotron_h.expert_count" not in r.fields
        assert tuple(t["blk.1.ffn_up.weight"].shape) == (64, 128) and "blk.1.ffn_gate.weight" not in t
        assert "blk.2.attn_q.weight" in t and "blk.0.attn_q.weight" not in t


@pytest.mark.parametrize("name", list(CASES))
def test_same_tensors_as_llamacpp(name, model, llamacpp_tree, tmp_path):
    assert_same_tensors_as_llamacpp(llamacpp_tree, model(name), tmp_path, exp_tensors=EXP_TENSORS)


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_q4_k_m(name, model, tmp_path):
    check_kquant(model(name), tmp_path)


def test_a_log_as_written_diverges(model, tmp_path, monkeypatch):
    """Negative control: ssm_a written as A_log itself (llama.cpp's scan takes A = -exp(A_log)) loads and runs,
    but its state decays no more (A >= 0 here: it grows until the logits overflow): parity shows it."""
    original = convert_mod.family_for

    def without_exp(arch):
        fam = original(arch)
        rules = tuple(dataclasses.replace(r, transform=dataclasses.replace(
            r.transform, apply=lambda xs, hp: [xs[0].reshape(-1, 1)])) if r.outputs == ("blk.{bid}.ssm_a",) else r
            for r in fam.tensors)
        return dataclasses.replace(fam, tensors=rules)

    monkeypatch.setattr(convert_mod, "family_for", without_exp)
    _, metrics, _ = convert_and_validate(model("nemotron_h"), tmp_path / "nemotron-a-log.gguf", "f16")
    assert metrics["top1_agreement"] < 0.5 and (metrics["finite"] is False or metrics["mean_kl"] > 0.05), metrics


@pytest.mark.parametrize("experts", [0], ids=["granite-4.0-h-micro"])
def test_granite4_dense_hybrid(experts, model, llamacpp_tree, tmp_path):
    """num_local_experts 0 (granite-4.0-h-micro): the shared MLP is each layer's dense SwiGLU (ffn_gate/up/down,
    width shared_intermediate_size), no expert keys (llama.cpp asserts none are used when there are none)."""
    d = model("granite4_h", "-dense", num_local_experts=experts, num_experts_per_tok=0, intermediate_size=96)
    _, metrics, _ = convert_and_validate(d, tmp_path / "dense-f16.gguf", "f16")
    assert metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-3, metrics
    r, t = FastGGUFReader(str(tmp_path / "dense-f16.gguf")), tensors(tmp_path / "dense-f16.gguf")
    assert field(r, "granitehybrid.feed_forward_length") == 96 and "granitehybrid.expert_count" not in r.fields
    assert tuple(t["blk.0.ffn_gate.weight"].shape) == (64, 96) and "blk.0.ffn_gate_shexp.weight" not in t
    assert_same_tensors_as_llamacpp(llamacpp_tree, d, tmp_path, exp_tensors=EXP_TENSORS)


def test_granite4_without_mamba_is_granite(model, llamacpp_tree, tmp_path):
    """granite-4.0-micro (GraniteMoeHybrid, every layer attention with rope, no experts) is written as llama.cpp's
    converter writes it: a dense `granite` model, Q and K permuted for its rope."""
    d = model("granite4_h", "-micro", num_local_experts=0, num_experts_per_tok=0, intermediate_size=96,
              position_embedding_type="rope",
              layer_types=["attention"] * 4)
    report, metrics, _ = convert_and_validate(d, tmp_path / "micro-f16.gguf", "f16")
    assert report.gguf_arch == "granite" and report.family == "granitehybrid-dense"
    assert metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-3, metrics
    r = FastGGUFReader(str(tmp_path / "micro-f16.gguf"))
    assert field(r, "granite.feed_forward_length") == 96 and field(r, "granite.embedding_scale") == 4.0
    assert_same_tensors_as_llamacpp(llamacpp_tree, d, tmp_path)


def test_transformers5_spellings_convert_alike(model, tmp_path):
    """As transformers 5 saves them (Nemotron-H: layers_block_type, no num_hidden_layers, MoE defaults; Granite:
    linear_attention / full_attention), the configs give the same keys and tensors as released."""
    for name in CASES:
        d = model(name)
        saved = copy_model(d, tmp_path / f"{name}-saved")
        if name == "nemotron_h":
            edit_config(saved, hybrid_override_pattern=None, num_hidden_layers=None,
                        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"], n_routed_experts=8,
                        num_experts_per_tok=2)
        else:
            edit_config(saved, layer_types=["linear_attention", "full_attention"] * 2)
        a, b = tmp_path / f"{name}-released.gguf", tmp_path / f"{name}-saved.gguf"
        convert_only(d, a), convert_only(saved, b)
        ra, rb = FastGGUFReader(str(a)), FastGGUFReader(str(b))
        keys = [k for k in ra.fields if not k.startswith(("general.", "GGUF."))]
        assert keys == [k for k in rb.fields if not k.startswith(("general.", "GGUF."))]
        assert all(np.array_equal(np.asarray(ra.fields[k].contents()), np.asarray(rb.fields[k].contents()))
                   for k in keys if not k.startswith("tokenizer."))
        ta, tb = tensors(a), tensors(b)
        assert set(ta) == set(tb) and all(np.asarray(ta[n].data).tobytes() == np.asarray(tb[n].data).tobytes()
                                          for n in ta)


def test_granite4_hybrid_with_rope_turns_llama_cpp_rope_on(model, tmp_path):
    """position_embedding_type "rope" (transformers supports it; no 4.0-H release uses it): llama.cpp's granitehybrid
    applies rope when `rope.scaling.finetuned` is true, which its converter writes false for every hybrid. Measured
    once on this model with rope: f16 top-1 0.997, KL 7e-7 here; llama.cpp's converter's file top-1 0.960, KL 7e-5."""
    d = copy_model(model("granite4_h"), tmp_path / "granite4-rope")
    edit_config(d, position_embedding_type="rope")
    out = tmp_path / "rope.gguf"
    convert_only(d, out)
    r = FastGGUFReader(str(out))
    assert field(r, "granitehybrid.rope.scaling.finetuned") is True
    assert field(r, "granitehybrid.context_length") == 512


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_reference_equals_from_pretrained(name, model):
    """The parity reference (streamed, one block resident) computes what `from_pretrained` does: Nemotron-H's
    `backbone.*` checkpoint names reach transformers 5's `model.*` parameters."""
    import torch

    from pipelines.validation.reference import load_model

    d = model(name)
    ids = list(range(100, 160))
    with streamed_model.StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        got = lm.logits(ids)
    with torch.inference_mode():
        expected = load_model(d)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - expected).max() < 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_imatrix_sees_the_mamba_projections(name, model, tmp_path):
    """The importance matrix has the Mamba projections' rows: ssm_in from the block norm's output, ssm_out from the
    gated norm's (d_inner columns), equal to forward pre-hooks on transformers' own modules; nothing is missing
    (tensors llama.cpp never quantizes, conv1d, A, D, routers, are not asked for); and libllama's Q4_K_M
    weighed by it validates."""
    import torch

    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix
    from pipelines.targets.gguf.quantize import quantize
    from pipelines.targets.gguf.validate import validate_gguf
    from pipelines.validation.reference import encode, load_model, load_tokenizer

    d = model(name)
    snap = fetch(str(d), f"test/{name}")
    out = tmp_path / f"{name}.imatrix.gguf"
    summary = imatrix.compute(snap, out)
    assert summary["missing"] == [], summary
    stored = {t.name: np.asarray(t.data, dtype=np.float64) for t in FastGGUFReader(str(out)).tensors}
    assert not any("ssm_conv1d" in n or "ssm_a" in n or "ffn_gate_inp" in n for n in stored)

    hf = load_model(d)
    mixer = hf.model.layers[0].mamba if name.startswith("granite4") else hf.model.layers[0].mixer
    sums = {"in_proj": 0.0, "out_proj": 0.0}
    def hook(m):
        def add(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[m] = sums[m] + (x * x).sum(0)
        return add

    hooks = [getattr(mixer, m).register_forward_pre_hook(hook(m)) for m in sums]
    ids = encode(load_tokenizer(d), [imatrix.calibration_text()])[0]
    with torch.no_grad():
        for lo in range(0, len(ids), imatrix.CHUNK_TOKENS):
            hf(torch.tensor([ids[lo:lo + imatrix.CHUNK_TOKENS]]))
    for h in hooks:
        h.remove()
    for gguf_name, module in (("ssm_in", "in_proj"), ("ssm_out", "out_proj")):
        got = stored[f"blk.0.{gguf_name}.weight.in_sum2"].reshape(-1)
        assert got.shape == (64 if module == "in_proj" else 128,)
        np.testing.assert_allclose(got, sums[module].numpy(), rtol=2e-4)
        assert stored[f"blk.0.{gguf_name}.weight.counts"].reshape(-1).tolist() == [summary["tokens"]]

    f16 = tmp_path / f"{name}-f16.gguf"
    convert_only(d, f16)
    q4 = tmp_path / f"{name}-imatrix-Q4_K_M.gguf"
    quantize(f16, q4, "Q4_K_M", imatrix=out)
    metrics, _ = validate_gguf(snap, q4)
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0 and metrics["mean_kl"] <= 0.1, metrics


# Real configs (as released; Hub unreachable here, values from the published config.json files)
NEMOTRON_NANO_9B_V2 = dict(architectures=["NemotronHForCausalLM"], hidden_size=4480, num_hidden_layers=56,
                           hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
                           num_attention_heads=40, num_key_value_heads=8, head_dim=128, intermediate_size=15680,
                           mamba_num_heads=128, mamba_head_dim=80, n_groups=8, ssm_state_size=128, conv_kernel=4,
                           expand=2, vocab_size=131072, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5)
GRANITE_4_H_SMALL = dict(architectures=["GraniteMoeHybridForCausalLM"], hidden_size=4096, num_hidden_layers=40,
                         layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
                         num_attention_heads=32, num_key_value_heads=8, mamba_n_heads=128, mamba_d_head=64,
                         mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, num_local_experts=72,
                         num_experts_per_tok=10, intermediate_size=768, shared_intermediate_size=8192,
                         vocab_size=100352, position_embedding_type="nope")


@pytest.mark.parametrize("cfg,mamba_layers,per_layer", [
    (NEMOTRON_NANO_9B_V2, 27, 3 * (10240 + 2 * 8 * 128) + 128 * 10240),
    (GRANITE_4_H_SMALL, 36, 3 * (8192 + 2 * 1 * 128) + 128 * 8192),
], ids=["Nemotron-Nano-9B-v2", "granite-4.0-h-small"])
def test_memory_plan_counts_the_recurrent_state(cfg, mamba_layers, per_layer):
    """llama.cpp's recurrent state per sequence and Mamba layer, f32: n_embd_r = (d_conv - 1) x (d_inner + 2 x
    groups x d_state) and n_embd_s = d_state x d_inner; the plan's validate step counts it beside a KV cache of
    the attention layers only."""
    from pipelines.model.memory import PlanEnv, facts_from_tensors, human_bytes
    from pipelines.targets.gguf.plan import KV_BYTES, RECURRENT_BYTES, VALIDATE_CTX, plan_steps, recurrent_cache

    hp = HParams(cfg)
    family = family_for(cfg["architectures"][0]).for_config(hp)
    family.key_values(hp)  # the real config is accepted
    assert family.recurrent_state(hp) == mamba_layers * per_layer
    assert recurrent_cache(cfg) == (4, mamba_layers * per_layer)
    print(f"{cfg['architectures'][0]}: {per_layer * RECURRENT_BYTES / 2**20:.2f} MiB per Mamba layer, "
          f"{mamba_layers * per_layer * RECURRENT_BYTES / 2**20:.1f} MiB per sequence")
    assert recurrent_cache({"architectures": ["LlamaForCausalLM"]}) == (None, 0)
    assert Mamba2(4, 128, 16, 8, 2).state_values == 3 * 192 + 16 * 128
    # the validate step: the state beside a KV cache of the 4 attention layers (512 tokens, f32 K and V)
    facts = facts_from_tensors([], cfg)
    env = PlanEnv(facts=facts, options={"outtype": "f16"}, config=cfg, work="/w", store=None, refs="/c",
                  linkable=True, budget=1 << 40)
    validate = next(s for s in plan_steps(env) if s.step == "validate")
    kv = VALIDATE_CTX * 4 * cfg["num_key_value_heads"] * 128 * 2 * KV_BYTES
    assert f"KV cache {human_bytes(kv)} + recurrent state {human_bytes(mamba_layers * per_layer * 4)}" in validate.detail


REFUSALS = [
    ("granite4_h", {"mamba_expand": 1, "mamba_d_head": 8}, r"inner size 2 x hidden_size only"),
    ("granite4_h", {"time_step_limit": [0.001, 100.0]}, r"never clamps the Mamba time step"),
    ("granite4_h", {"mamba_conv_bias": False}, r"always adds a conv bias"),
    ("granite4_h", {"position_embedding_type": "alibi"}, r"runs rope or no positions"),
    ("granite4_h", {"layer_types": ["mamba", "cross", "mamba", "attention"]}, r"layer_types must name"),
    ("granite4_h", {"layer_types": ["attention"] * 4}, r"without Mamba layers but with experts"),
    ("granite4_h", {"mamba_n_groups": 3}, r"form 3 equal groups"),
    ("nemotron_h", {"hybrid_override_pattern": "M-*E"}, r"nemotron_h_moe, not supported yet"),
    ("nemotron_h", {"hybrid_override_pattern": "M-*"}, r"pattern has 3 layers, num_hidden_layers is 4"),
    ("nemotron_h", {"mlp_hidden_act": "silu"}, r"squared ReLU"),
    ("nemotron_h", {"use_bias": True}, r"no biases"),
    ("nemotron_h", {"use_conv_bias": False}, r"always adds one"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_layouts_llama_cpp_cannot_run_are_refused(name, change, message, model, tmp_path):
    assert_refused(model(name), tmp_path, change, message)
