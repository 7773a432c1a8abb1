"""GGUF families Cohere 2 (Command R7B), GLM-4, Granite MoE, OLMoE and Hunyuan dense on tiny random models:
converted to f16 and q8_0 and validated in llama.cpp against transformers fp32
(`gguf_family_check.check_family`), plus what is special to each family (GGUF keys and shapes), a negative
control per family for the transform or key that matters, the layouts llama.cpp cannot run (one-line
refusals), and the streamed reference against `from_pretrained` for each architecture.

SmolLM2's BPE tokenizer cut to 2,048 tokens is copied into every model and each conversion names its
pre-tokenizer (`gguf_family_check`); none of these model types makes transformers read the full tokenizer with
another pre-tokenizer (`test_full_smollm2_vocabulary_is_recognised`). The MoE models are built as in
test_gguf_families_moe.py (weights 0.1, router weights scaled 4x, so the routers are decisive): OLMoE's
router is `mlp.gate`, which `make_causal_lm(router_scale=...)` scales; Granite MoE's is
`block_sparse_moe.router`, scaled here after building. Sliding windows are 16 tokens, shorter than every
parity prompt, so Cohere 2's windows and its rope-less full layers are both exercised.

Granite MoE checkpoints keep their experts stacked under JetMoE names (`block_sparse_moe.input_linear`,
`output_linear`, `router.layer`) that transformers 5 renames when it loads them (and so does the streamed
reference, `streamed_model.MODULE_RENAMES`).
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
    convert_and_validate,
    convert_only,
    field,
    tensors,
)
from gguf_reader import FastGGUFReader

from pipelines.model import streamed_model
from pipelines.targets.gguf import convert as convert_mod
from pipelines.targets.gguf.families import glm4 as glm4_mod, hunyuan_dense as hunyuan_mod
from pipelines.targets.gguf.families.spec import A, accept

VOCAB = SMALL_BPE_VOCAB  # SmolLM2's tokenizer cut to 2,048 tokens (gguf_family_check)
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
MOE = dict(TINY, initializer_range=0.1)
ALPHA = 1000.0  # Hunyuan's NTK alpha (the released checkpoints use 1000)

# name: (config class, model class, config, gguf arch, router scale)
CASES = {
    # layer 0 slides (rope, window 16), layer 1 is global (no rope); tied by transformers' default
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                dict(TINY, tie_word_embeddings=None, sliding_window=16, logit_scale=0.25,
                     layer_types=["sliding_attention", "full_attention"]), "cohere2", 1.0),
    # head_dim 16, partial rotary 0.5 (transformers' default): 8 of 16 dimensions rotate
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(TINY, head_dim=16, pad_token_id=0, eos_token_id=1), "glm4", 1.0),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(MOE, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=4.0,
                        residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0), "granitemoe", 4.0),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(MOE, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
              "olmoe", 4.0),
    # head_dim 32 with hidden 64 / 4 heads (16): the key length is head_dim; Hunyuan's "dynamic" rope with alpha
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM",
                      dict(TINY, head_dim=32, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                               "alpha": ALPHA, "factor": 1.0}),
                      "hunyuan-dense", 1.0),
}

def _scale_granitemoe_router(d: Path, scale: float) -> None:
    def edit(ts):
        for n in ts:
            if n.endswith("block_sparse_moe.router.layer.weight"):
                ts[n] = ts[n] * np.float32(scale)
    rewrite_safetensors(d, edit)


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-wide-models")

    def build(name: str) -> Path:
        if name not in built:
            cfg_cls, model_cls, params, _, router_scale = CASES[name]
            params = {k: v for k, v in params.items() if v is not None}
            d = make_causal_lm(cfg_cls, model_cls, params, root / name, tokenizer_dir=smollm2_small_vocab_dir,
                               router_scale=router_scale)
            if name == "granitemoe":  # its router is not `mlp.gate`: make_causal_lm left it alone
                _scale_granitemoe_router(d, router_scale)
            built[name] = d
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
    gguf_arch = CASES[name][3]
    d = model(name)
    arch = json.loads((d / "config.json").read_text())["architectures"][0]
    results = check_family(d, tmp_path, gguf_arch)
    report = results["f16"][0]
    assert report.architecture == arch and report.family == name
    path = tmp_path / f"{d.name}-f16.gguf"
    r = FastGGUFReader(str(path))
    t = tensors(path)
    if name == "cohere2":
        assert field(r, "cohere2.logit_scale") == pytest.approx(0.25)
        assert field(r, "cohere2.attention.sliding_window") == 16
        assert field(r, "cohere2.attention.sliding_window_pattern") == [True, False]
        assert field(r, "cohere2.attention.layer_norm_epsilon") == pytest.approx(1e-5)
        assert "output.weight" not in t  # tied (transformers' default for Cohere 2): llama.cpp uses token_embd
        assert "blk.0.ffn_norm.weight" not in t  # the parallel block has one norm
    elif name == "glm4":
        assert field(r, "glm4.rope.dimension_count") == 8  # 16 * 0.5
        assert "glm4.rope.dimension_sections" not in r.fields
        assert tuple(t["blk.0.ffn_up.weight"].shape) == (64, 256)  # [gate; up] kept fused
        for n in ("post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_norm"):
            assert tuple(t[f"blk.1.{n}.weight"].shape) == (64,)
        assert "blk.0.attn_q.bias" in t and "blk.0.attn_output.bias" not in t
    elif name == "granitemoe":
        assert field(r, "granitemoe.embedding_scale") == pytest.approx(4.0)
        assert field(r, "granitemoe.residual_scale") == pytest.approx(0.5)
        assert field(r, "granitemoe.attention.scale") == pytest.approx(0.1)
        assert field(r, "granitemoe.logit_scale") == pytest.approx(2.0)
        assert field(r, "granitemoe.expert_count") == 4 and field(r, "granitemoe.expert_used_count") == 2
        # GGUF shapes read back reversed: [cols, rows, experts]
        assert tuple(t["blk.0.ffn_gate_exps.weight"].shape) == (64, 128, 4)
        assert tuple(t["blk.0.ffn_up_exps.weight"].shape) == (64, 128, 4)
        assert tuple(t["blk.1.ffn_down_exps.weight"].shape) == (128, 64, 4)
        assert tuple(t["blk.0.ffn_gate_inp.weight"].shape) == (64, 4)
        # the first half of each expert's input_linear rows is its gate, the second its up
        from safetensors.numpy import load_file

        fused = load_file(str(d / "model.safetensors"))["model.layers.1.block_sparse_moe.input_linear.weight"]
        for exps, half in (("ffn_gate_exps", fused[:, :128]), ("ffn_up_exps", fused[:, 128:])):
            np.testing.assert_array_equal(np.asarray(t[f"blk.1.{exps}.weight"].data), half.astype(np.float16))
    elif name == "olmoe":
        assert field(r, "olmoe.expert_count") == 4 and field(r, "olmoe.expert_used_count") == 2
        assert tuple(t["blk.0.attn_q_norm.weight"].shape) == (64,)  # over all heads, not per head
        assert tuple(t["blk.0.attn_k_norm.weight"].shape) == (64,)
        assert tuple(t["blk.1.ffn_gate_exps.weight"].shape) == (64, 128, 4)
        assert "output.weight" in t
    elif name == "hunyuan_dense":
        assert field(r, "hunyuan-dense.rope.freq_base") == pytest.approx(10000.0 * ALPHA ** (32 / 30), rel=1e-6)
        assert "hunyuan-dense.rope.scaling.alpha" not in r.fields  # the base is pre-scaled: never twice
        assert "hunyuan-dense.rope.scaling.type" not in r.fields
        assert field(r, "hunyuan-dense.attention.key_length") == 32
        assert field(r, "hunyuan-dense.rope.dimension_count") == 32
        assert tuple(t["blk.0.attn_q_norm.weight"].shape) == (32,)
        assert tuple(t["blk.0.attn_q.weight"].shape) == (64, 4 * 32)


def _patched_family(monkeypatch, change) -> None:
    original = convert_mod.family_for
    monkeypatch.setattr(convert_mod, "family_for", lambda arch: change(original(arch)))


def test_cohere2_sliding_pattern_matters(model, tmp_path, monkeypatch):
    """Negative control: without the per-layer pattern llama.cpp falls back to "three sliding, then one full",
    so the global layer 1 gets a window and a rope it does not have in HF."""
    pattern = A.SLIDING_WINDOW_PATTERN
    _patched_family(monkeypatch, lambda fam: dataclasses.replace(
        fam, params=tuple(p for p in fam.params if p.key != pattern)))
    out = tmp_path / "cohere2-no-pattern.gguf"
    _, metrics, _ = convert_and_validate(model("cohere2"), out, "f16")
    assert "cohere2.attention.sliding_window_pattern" not in FastGGUFReader(str(out)).fields
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics
    assert metrics["top1_agreement"] < 0.95, metrics  # its logits are flat: top-1 shows it plainly


def test_glm4_partial_rotary_factor_matters(model, tmp_path, monkeypatch):
    """Negative control: every dimension rotated (the generic partial_rotary_factor default, 1.0) instead of
    glm4's half; and a config without the factor still gets transformers' glm4 default of 0.5."""
    monkeypatch.setattr(glm4_mod, "rotary_factor", lambda hp: 1.0)
    out = tmp_path / "glm4-full-rotary.gguf"
    _, metrics, _ = convert_and_validate(model("glm4"), out, "f16")
    assert field(FastGGUFReader(str(out)), "glm4.rope.dimension_count") == 16
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics
    monkeypatch.undo()

    import transformers

    d = copy_model(model("glm4"), tmp_path / "glm4")
    cfg = json.loads((d / "config.json").read_text())
    edit_config(d, rope_parameters={k: v for k, v in cfg["rope_parameters"].items() if k != "partial_rotary_factor"})
    assert transformers.AutoConfig.from_pretrained(d).rope_parameters["partial_rotary_factor"] == 0.5
    out = tmp_path / "glm4-no-factor.gguf"
    convert_only(d, out)
    assert field(FastGGUFReader(str(out)), "glm4.rope.dimension_count") == 8


def test_granitemoe_gate_up_order_matters(model, tmp_path, monkeypatch):
    """Negative control: input_linear's halves swapped (up as gate) load and run, and diverge."""
    def swapped(fam):
        rules = tuple(dataclasses.replace(r, outputs=r.outputs[::-1]) if len(r.outputs) == 2 else r
                      for r in fam.tensors)
        assert [r.outputs for r in rules if len(r.outputs) == 2] == [("blk.{bid}.ffn_up_exps.weight",
                                                                       "blk.{bid}.ffn_gate_exps.weight")]
        return dataclasses.replace(fam, tensors=rules)

    _patched_family(monkeypatch, swapped)
    _, metrics, _ = convert_and_validate(model("granitemoe"), tmp_path / "granitemoe-swapped.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics
    assert metrics["top1_agreement"] < 0.95, metrics  # its logits are flat: top-1 shows it plainly


def test_olmoe_renormalized_top_k_is_rightly_refused(model, tmp_path, monkeypatch):
    """Negative control for a refusal: a norm_topk_prob=true OLMoE converted anyway (its check bypassed) runs
    in llama.cpp without the renormalization, and diverges from transformers."""
    d = copy_model(model("olmoe"), tmp_path / "olmoe")
    edit_config(d, norm_topk_prob=True)
    _patched_family(monkeypatch, lambda fam: dataclasses.replace(fam, check=accept))
    _, metrics, _ = convert_and_validate(d, tmp_path / "olmoe-renormalized.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics
    assert metrics["top1_agreement"] < 0.95, metrics  # its logits are flat: top-1 shows it plainly


def test_hunyuan_alpha_base_matters(model, tmp_path, monkeypatch):
    """Negative control: the unscaled rope_theta (the generic "dynamic" rope: a no-op inside the context)
    instead of the NTK-alpha base transformers uses at every length."""
    monkeypatch.setattr(hunyuan_mod, "alpha", lambda hp: None)
    out = tmp_path / "hunyuan-unscaled.gguf"
    _, metrics, _ = convert_and_validate(model("hunyuan_dense"), out, "f16")
    assert field(FastGGUFReader(str(out)), "hunyuan-dense.rope.freq_base") == pytest.approx(10000.0)
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 1e-3, metrics


REFUSALS = [
    ("cohere2", {"tie_word_embeddings": False}, r"cohere2 with tie_word_embeddings=false is not supported"),
    ("cohere2", {"attention_bias": True}, r"cohere2 with attention_bias=true is not supported"),
    ("cohere2", {"sliding_window": None}, r"cohere2 with sliding_window=null is not supported"),
    ("cohere2", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
     r"rope scaling type 'linear' is not supported for cohere2"),
    ("cohere2", {"hidden_act": "gelu"}, r"cohere2 with activation 'gelu' is not supported"),
    ("glm4", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "mrope_section": [2, 3, 3]}}, r"glm4 GGUF with mrope_section"),
    ("glm4", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 128}},
     r"rope scaling type 'yarn' is not supported for glm4"),
    ("granitemoe", {"head_dim": 32}, r"granite GGUF needs head_dim == hidden_size / num_attention_heads"),
    ("olmoe", {"norm_topk_prob": True}, r"olmoe GGUF: llama.cpp never renormalizes"),
    ("olmoe", {"tie_word_embeddings": True},
     r"olmoe with tie_word_embeddings=true is not supported: llama.cpp's olmoe requires an untied output"),
    ("olmoe", {"num_key_value_heads": 2}, r"olmoe GGUF needs num_key_value_heads == num_attention_heads"),
    ("olmoe", {"clip_qkv": 8.0}, r"olmoe with clip_qkv=8.0 is not supported"),
    ("olmoe", {"attention_bias": True}, r"olmoe with attention_bias=true is not supported"),
    ("hunyuan_dense", {"attention_bias": True}, r"hunyuan-dense with attention_bias=true is not supported"),
    ("hunyuan_dense", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}},
     r"rope scaling type 'llama3' is not supported for hunyuan-dense"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_layouts_llama_cpp_cannot_run_are_refused(name, change, message, model, tmp_path):
    assert_refused(model(name), tmp_path, change, message)


def test_cohere2_tied_by_default(model, tmp_path):
    """A Cohere 2 config without tie_word_embeddings is tied (transformers' default for it): converted with no
    output matrix, and its lm_head, if a checkpoint carries a copy, is dropped rather than refused."""
    d = copy_model(model("cohere2"), tmp_path / "cohere2")
    edit_config(d, tie_word_embeddings=None)
    out = tmp_path / "cohere2-default-tie.gguf"
    convert_only(d, out)
    assert "output.weight" not in tensors(out)


def test_hunyuan_single_expert_is_dense(model, tmp_path):
    """Some dense Hunyuan configs say num_experts=1: no expert count is written (llama.cpp would read a MoE)."""
    d = copy_model(model("hunyuan_dense"), tmp_path / "hunyuan")
    edit_config(d, num_experts=1)
    out = tmp_path / "hunyuan-one-expert.gguf"
    convert_only(d, out)
    assert "hunyuan-dense.expert_count" not in FastGGUFReader(str(out)).fields


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_reference_equals_from_pretrained(name, model):
    """The parity reference (streamed, one block resident) computes what `from_pretrained` does."""
    import torch

    from pipelines.validation.reference import load_model

    d = model(name)
    ids = list(range(100, 160))
    with streamed_model.StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        got = lm.logits(ids)
    with torch.inference_mode():
        expected = load_model(d)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - expected).max() < 1e-4


@pytest.mark.parametrize("name", ["granitemoe", "olmoe"])
def test_imatrix_covers_every_expert(name, model):
    """Per-expert importance rows for experts stacked in the checkpoint (Granite MoE's input_linear, one tensor
    for gate and up) as for per-expert tensors (OLMoE): nothing missing, and every token counted top-k times."""
    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix

    d = model(name)
    out = d.parent / f"{name}.imatrix.gguf"
    summary = imatrix.compute(fetch(str(d), f"test/{name}"), out)
    assert summary["missing"] == [], summary
    stored = {t.name: np.asarray(t.data) for t in FastGGUFReader(str(out)).tensors}
    k = CASES[name][2]["num_experts_per_tok"]
    for tensor in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        counts = stored[f"blk.0.{tensor}.weight.counts"].reshape(-1)
        assert len(counts) == 4 and counts.sum() == k * summary["tokens"] and counts.min() > 0, (tensor, counts)
    # gate and up read the same input: the same sums
    np.testing.assert_array_equal(stored["blk.1.ffn_gate_exps.weight.in_sum2"], stored["blk.1.ffn_up_exps.weight.in_sum2"])


LLAMACPP_CASES = list(CASES)
# keys llama.cpp's converter reads as the released configs spell them: Command R7B's rotary_pct; HunYuan's
# converter asserts the released 32k context of its dynamic-rope models
RELEASED_KEYS = {"cohere2": {"rotary_pct": 1.0}, "hunyuan_dense": {"max_position_embeddings": 32768}}


@pytest.mark.parametrize("name", LLAMACPP_CASES)
def test_same_tensors_as_llamacpp(name, model, tmp_path, llamacpp_tree):
    """f16 tensors byte-identical to llama.cpp's own converter on the same checkpoint (gguf_family_check; the
    vocabulary is held by the token-parity tests)."""
    assert_same_tensors_as_llamacpp(llamacpp_tree, model(name), tmp_path, tensors_only=True,
                                    released_keys=RELEASED_KEYS.get(name))
