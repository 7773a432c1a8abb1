"""GGUF families Granite, Mixtral, Qwen2-MoE, Qwen3, Qwen3-MoE (and Mistral, declared in llama.py) on tiny
random models: converted to f16 and q8_0 and validated in llama.cpp against transformers fp32
(`gguf_family_check.check_family`), plus what is special to each family and the layouts llama.cpp cannot run.

SmolLM2's BPE tokenizer cut to 2,048 tokens is copied into every model, and every conversion names its
pre-tokenizer, "smollm" (`gguf_family_check`). transformers 5 reads the tokenizer with its generic class for the
Qwen model types too, so the full vocabulary is recognised by its hash for all of them
(`test_full_smollm2_vocabulary_is_recognised`), and qwen2's pre-tokenizer would be wrong (it splits "\n\n"
differently: token parity catches it).

Random MoE routers: with the dense cases' weights (initializer_range 0.2) a random router's top-2 often sits near
a tie that the rounding of f16 / q8_0 activations flips (measured: Mixtral f16 top-1 0.996 but q8_0 KL 0.031,
max KL 1.4 at the flipped positions). A trained router is decisive, so the MoE models here are built with
smaller weights (0.1) and their router weights scaled 4x (`router_scale`): then they meet the dense bar
unchanged (f16 KL 6e-7, q8_0 KL 0.0006) and no MoE exception is needed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, make_causal_lm
from gguf_family_check import (
    assert_full_vocab_recognised,
    assert_refused,
    assert_same_tensors_as_llamacpp,
    calibration_inputs,
    check_family,
    convert_and_validate,
    field,
    tensors,
)
from gguf_reader import FastGGUFReader

from pipelines.targets.gguf import convert as convert_mod

VOCAB = SMALL_BPE_VOCAB  # SmolLM2's tokenizer cut to 2,048 tokens (gguf_family_check)
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)

# name: (config class, model class, config, gguf arch, convert options, router scale)
MOE = dict(TINY, initializer_range=0.1)
CASES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(TINY), "llama", None, 1.0),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(TINY, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
                     logits_scaling=2.0), "granite", None, 1.0),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(MOE, num_local_experts=4, num_experts_per_tok=2),
                "llama", None, 4.0),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=96, norm_topk_prob=False), "qwen2moe", None, 4.0),
    # head_dim 32 with hidden 64 / 4 heads (16): Qwen3 sets head_dim on its own (Qwen3-4B: 128 vs 2560/32)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY, head_dim=32, tie_word_embeddings=True), "qwen3",
              None, 1.0),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(MOE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       norm_topk_prob=True), "qwen3moe", None, 4.0),
}


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-moe-models")

    def build(name: str) -> Path:
        if name not in built:
            cfg_cls, model_cls, params, *_, router_scale = CASES[name]
            built[name] = make_causal_lm(cfg_cls, model_cls, params, root / name, tokenizer_dir=smollm2_small_vocab_dir,
                                         router_scale=router_scale)
        return built[name]

    return build





# one case per config class: transformers picks the tokenizer class by model type
FULL_VOCAB_CASES = {case[0]: case[2] for case in reversed(CASES.values())}


@pytest.mark.parametrize("config_class", sorted(FULL_VOCAB_CASES))
def test_full_smollm2_vocabulary_is_recognised(config_class, smollm2_dir, tmp_path):
    """The cut vocabulary's conversions name the pre-tokenizer; the full one needs no name, for each model type."""
    params = {k: v for k, v in FULL_VOCAB_CASES[config_class].items() if v is not None}
    assert_full_vocab_recognised(config_class, params, smollm2_dir, tmp_path)


@pytest.mark.parametrize("name", list(CASES))
def test_family_parity(name, model, tmp_path):
    *_, gguf_arch, options, _ = CASES[name]
    d = model(name)
    arch = json.loads((d / "config.json").read_text())["architectures"][0]
    results = check_family(d, tmp_path, gguf_arch, options=options)
    report = results["f16"][0]
    assert report.architecture == arch
    path = tmp_path / f"{d.name}-f16.gguf"
    r = FastGGUFReader(str(path))
    t = tensors(path)
    if name == "mistral":
        assert report.family == "llama"
    elif name == "granite":
        assert field(r, "granite.embedding_scale") == pytest.approx(4.0)
        assert field(r, "granite.residual_scale") == pytest.approx(0.5)
        assert field(r, "granite.attention.scale") == pytest.approx(0.1)
        assert field(r, "granite.logit_scale") == pytest.approx(2.0)
    elif name == "mixtral":
        assert field(r, "llama.expert_count") == 4 and field(r, "llama.expert_used_count") == 2
        # GGUF shapes read back reversed: [cols, rows, experts]
        assert tuple(t["blk.0.ffn_gate_exps.weight"].shape) == (64, 128, 4)
        assert tuple(t["blk.1.ffn_up_exps.weight"].shape) == (64, 128, 4)
        assert tuple(t["blk.1.ffn_down_exps.weight"].shape) == (128, 64, 4)
        assert tuple(t["blk.0.ffn_gate_inp.weight"].shape) == (64, 4)
        assert "blk.0.ffn_gate.weight" not in t
    elif name == "qwen2_moe":
        assert field(r, "qwen2moe.expert_feed_forward_length") == 64
        assert field(r, "qwen2moe.expert_shared_feed_forward_length") == 96
        gate = t["blk.1.ffn_gate_inp_shexp.weight"]  # the shared expert's gate: [1, hidden] as llama.cpp writes it, f32
        assert tuple(gate.shape) == (64, 1) and gate.tensor_type == gguf.GGMLQuantizationType.F32
        assert tuple(t["blk.0.ffn_gate_shexp.weight"].shape) == (64, 96)
        assert tuple(t["blk.0.ffn_down_exps.weight"].shape) == (64, 64, 4)
        assert "blk.0.attn_q.bias" in t
    elif name == "qwen3":
        assert field(r, "qwen3.attention.key_length") == 32 and field(r, "qwen3.attention.value_length") == 32
        assert tuple(t["blk.0.attn_q_norm.weight"].shape) == (32,)
        assert tuple(t["blk.0.attn_q.weight"].shape) == (64, 4 * 32)
        assert "output.weight" not in t  # tied: llama.cpp reuses token_embd
    elif name == "qwen3_moe":
        assert field(r, "qwen3moe.expert_feed_forward_length") == 64
        assert tuple(t["blk.1.attn_k_norm.weight"].shape) == (16,)
        assert tuple(t["blk.1.ffn_gate_exps.weight"].shape) == (64, 64, 4)


def test_granite_multipliers_matter(model, tmp_path, monkeypatch):
    """Negative control: Granite without its embedding / residual / attention multipliers (llama.cpp's defaults
    instead) loads and runs, but only parity shows it computes another model."""
    original = convert_mod.family_for
    scales = ("{arch}.embedding_scale", "{arch}.residual_scale", "{arch}.attention.scale")

    def without_multipliers(arch):
        fam = original(arch)
        return dataclasses.replace(fam, params=tuple(p for p in fam.params if p.key not in scales))

    monkeypatch.setattr(convert_mod, "family_for", without_multipliers)
    out = tmp_path / "granite-no-multipliers.gguf"
    _, metrics, _ = convert_and_validate(model("granite"), out, "f16")
    assert "granite.residual_scale" not in FastGGUFReader(str(out)).fields
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 0.1


def test_mixtral_expert_order_matters(model, tmp_path, monkeypatch):
    """Negative control: experts stacked in reverse order (each router column then picks another expert's
    weights) diverge, so the parity run really routes through the stacked experts."""
    original_expand = convert_mod._expand

    def reversed_experts(names, bid, hp):
        out = original_expand(names, bid, hp)
        return out[::-1] if any("{xid}" in n for n in names) else out

    monkeypatch.setattr(convert_mod, "_expand", reversed_experts)
    _, metrics, _ = convert_and_validate(model("mixtral"), tmp_path / "mixtral-reversed.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 0.05


REFUSALS = [
    ("qwen3_moe", {"mlp_only_layers": [1]}, r"qwen3moe GGUF: layers \[1\] are dense"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, r"qwen3moe GGUF: layers \[0\] are dense"),
    ("qwen3_moe", {"norm_topk_prob": False}, r"llama.cpp always renormalizes"),
    ("qwen2_moe", {"mlp_only_layers": [0]}, r"qwen2moe GGUF: layers \[0\] are dense"),
    ("qwen2_moe", {"norm_topk_prob": True}, r"llama.cpp never renormalizes"),
    ("qwen2_moe", {"tie_word_embeddings": True}, r"requires an untied output"),
    ("granite", {"head_dim": 32}, r"granite GGUF needs head_dim == hidden_size / num_attention_heads"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_layouts_llama_cpp_cannot_run_are_refused(name, change, message, model, tmp_path):
    assert_refused(model(name), tmp_path, change, message, CASES[name][4])


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_imatrix_covers_stacked_experts_from_the_tokens_routed_to_each(name, model, tmp_path):
    """The importance matrix has a row of sums per expert (llama.cpp's layout for stacked experts), made only
    from the tokens the router sends to that expert. Checked against a computation of our own here: the MoE
    block's input captured from transformers' forward, routed with the router's own weights (top-k of its
    logits), and act(x W_gate) * (x W_up) per expert for the down projection's input."""
    import torch

    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix
    from pipelines.validation.reference import encode, load_model, load_tokenizer

    d = model(name)
    snap = fetch(str(d), f"test/{name}")
    out = tmp_path / f"{name}.imatrix.gguf"
    summary = imatrix.compute(snap, out)
    assert summary["missing"] == [], summary
    r = FastGGUFReader(str(out))
    stored = {t.name: t.data for t in r.tensors}
    cfg = json.loads((d / "config.json").read_text())
    n_exp, k = cfg.get("num_local_experts") or cfg["num_experts"], cfg["num_experts_per_tok"]

    hf = load_model(d)
    ids = encode(load_tokenizer(d), [imatrix.calibration_text()])[0]
    moe = hf.model.layers[1].mlp
    x = calibration_inputs(hf, moe, ids)
    router = moe.gate.weight.detach().double()
    chosen = torch.topk(x @ router.T, k, dim=-1).indices
    gate_up, down_in = moe.experts.gate_up_proj.detach().double(), []
    counts, x_sums = [], []
    for e in range(n_exp):
        xe = x[(chosen == e).any(dim=-1)]
        g, u = (xe @ gate_up[e].T).chunk(2, dim=-1)
        down_in.append(((torch.nn.functional.silu(g) * u) ** 2).sum(0))
        counts.append(xe.shape[0])
        x_sums.append((xe * xe).sum(0))
    assert sum(counts) == k * x.shape[0] and min(counts) > 0  # every expert reached: a real test of the rows
    for tensor, expect in (("ffn_gate_exps", x_sums), ("ffn_up_exps", x_sums), ("ffn_down_exps", down_in)):
        got = np.asarray(stored[f"blk.1.{tensor}.weight.in_sum2"], dtype=np.float64).reshape(n_exp, -1)
        np.testing.assert_allclose(got, torch.stack(expect).numpy(), rtol=2e-4)
        assert np.asarray(stored[f"blk.1.{tensor}.weight.counts"]).reshape(-1).tolist() == counts


LLAMACPP_CASES = list(CASES)


@pytest.mark.parametrize("name", LLAMACPP_CASES)
def test_same_tensors_as_llamacpp(name, model, tmp_path, llamacpp_tree):
    """f16 tensors byte-identical to llama.cpp's own converter on the same checkpoint (gguf_family_check; the
    vocabulary is held by the token-parity tests)."""
    assert_same_tensors_as_llamacpp(llamacpp_tree, model(name), tmp_path, tensors_only=True,
                                    options=CASES[name][4])
