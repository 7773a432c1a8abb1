"""GGUF families Gemma, Gemma 2, Gemma 3 (text), Cohere Command-R, OLMo 2 and StableLM 2 on tiny random models:
converted to f16 and q8_0 and validated in llama.cpp against transformers fp32
(`gguf_family_check.check_family`), plus what is special to each family, negative controls for the
transforms that matter, and the layouts llama.cpp cannot run.

SmolLM2's BPE tokenizer cut to 2,048 tokens is copied into every model (`gguf_family_check`). Norm weights are
randomized around 1 (Gemma's around 0: it scales by 1 + w), so a missing or wrong norm transform shows in the
parity numbers.
Sliding windows are 16 tokens, shorter than every parity prompt (85-133 tokens), so they are exercised.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest
from factories import SMALL_BPE_VOCAB, copy_model, edit_config, make_causal_lm
from gguf_family_check import (
    assert_full_vocab_recognised,
    assert_refused,
    assert_same_tensors_as_llamacpp,
    check_family,
    convert_and_validate,
    field,
    tensors,
)
from gguf_reader import FastGGUFReader

from pipelines.targets.gguf import GgufTarget, convert as convert_mod
from pipelines.targets.gguf.families.spec import IDENTITY, PLUS_ONE

VOCAB = SMALL_BPE_VOCAB  # SmolLM2's tokenizer cut to 2,048 tokens (gguf_family_check)
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
# head_dim 32 with hidden 64 / 4 heads (16): Gemma sets head_dim on its own (Gemma 7B: 256 vs 3072 / 16)
GEMMA = dict(TINY, head_dim=32, tie_word_embeddings=True)

# name: (config class, model class, config, gguf arch, convert options)
CASES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(GEMMA, hidden_act="gelu_pytorch_tanh"), "gemma", None),
    # small caps so that both soft-cappings bite on random weights; query_pre_attn_scalar = head_dim as llama.cpp
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(GEMMA, query_pre_attn_scalar=32, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
                    sliding_window=16), "gemma2", None),
    # layer 0 slides (local rope base 1e4), layer 1 is global (base 1e6, linear scaling 2x); untied output
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(GEMMA, tie_word_embeddings=False, query_pre_attn_scalar=32, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=8.0,
                    rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0,
                                                        "factor": 2.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
               "gemma3", None),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(TINY, tie_word_embeddings=True, logit_scale=0.25),
               "command-r", None),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(TINY), "olmo2", None),
    # StableLM 2 1.6B's layout: q/k/v biases, sequential blocks, a quarter of each head rotated
    "stablelm": ("StableLmConfig", "StableLmForCausalLM",
                 dict(TINY, use_qkv_bias=True, use_parallel_residual=False, layer_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
                 "stablelm", None),
    # StableLM 2 12B's layout: parallel blocks (no post-attention norm), per-head q/k LayerNorms
    "stablelm_12b": ("StableLmConfig", "StableLmForCausalLM",
                     dict(TINY, use_qkv_bias=False, use_parallel_residual=True, qk_layernorm=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.25}),
                     "stablelm", None),
}


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-gemma-models")

    def build(name: str) -> Path:
        if name not in built:
            cfg_cls, model_cls, params, *_ = CASES[name]
            built[name] = make_causal_lm(cfg_cls, model_cls, params, root / name, tokenizer_dir=smollm2_small_vocab_dir)
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
    *_, gguf_arch, options = CASES[name]
    d = model(name)
    arch = json.loads((d / "config.json").read_text())["architectures"][0]
    results = check_family(d, tmp_path, gguf_arch, options=options)
    report = results["f16"][0]
    assert report.architecture == arch
    path = tmp_path / f"{d.name}-f16.gguf"
    r = FastGGUFReader(str(path))
    t = tensors(path)
    a = gguf_arch
    if name == "gemma":
        assert field(r, "gemma.attention.key_length") == 32 and field(r, "gemma.attention.value_length") == 32
        assert tuple(t["blk.0.attn_q.weight"].shape) == (64, 4 * 32)
        assert "output.weight" not in t  # llama.cpp's gemma always reuses token_embd
    elif name == "gemma2":
        assert field(r, "gemma2.attn_logit_softcapping") == pytest.approx(4.0)
        assert field(r, "gemma2.final_logit_softcapping") == pytest.approx(8.0)
        assert field(r, "gemma2.attention.sliding_window") == 16
        assert list(field(r, "gemma2.attention.sliding_window_pattern")) == [True, False]
        assert {"blk.1.post_attention_norm.weight", "blk.1.ffn_norm.weight", "blk.1.post_ffw_norm.weight"} <= set(t)
    elif name == "gemma3":
        assert field(r, "gemma3.rope.freq_base") == pytest.approx(1e6)
        assert field(r, "gemma3.rope.freq_base_swa") == pytest.approx(1e4)
        assert field(r, "gemma3.rope.scaling.type") == "linear"
        assert field(r, "gemma3.rope.scaling.factor") == pytest.approx(2.0)
        assert field(r, "gemma3.attention.sliding_window") == 16
        assert list(field(r, "gemma3.attention.sliding_window_pattern")) == [True, False]
        assert field(r, "gemma3.final_logit_softcapping") == pytest.approx(8.0)
        assert "gemma3.attn_logit_softcapping" not in r.fields
        assert tuple(t["blk.0.attn_q_norm.weight"].shape) == (32,)
        assert "output.weight" in t  # untied: gemma3 takes an output matrix of its own
    elif name == "cohere":
        assert field(r, "command-r.logit_scale") == pytest.approx(0.25)
        assert field(r, "command-r.rope.scaling.type") == "none"
        assert "blk.0.ffn_norm.weight" not in t and "output.weight" not in t  # parallel block, tied output
        assert "blk.0.attn_norm.bias" not in t
    elif name == "olmo2":
        assert tuple(t["blk.0.attn_q_norm.weight"].shape) == (64,)  # the whole projection, not one head
        assert tuple(t["blk.0.attn_k_norm.weight"].shape) == (2 * 16,)
        assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= set(t)
        assert "blk.0.attn_norm.weight" not in t and "blk.0.ffn_norm.weight" not in t
    elif name == "stablelm":
        assert field(r, f"{a}.rope.dimension_count") == 4  # 0.25 x head_dim 16
        assert field(r, f"{a}.use_parallel_residual") is False
        assert {"blk.1.attn_q.bias", "blk.1.ffn_norm.bias", "blk.1.attn_norm.bias", "output_norm.bias"} <= set(t)
        assert "blk.0.attn_q_norm.weight" not in t
    elif name == "stablelm_12b":
        assert field(r, f"{a}.use_parallel_residual") is True
        assert "blk.0.ffn_norm.weight" not in t and "blk.0.attn_q.bias" not in t
        q8 = tensors(tmp_path / f"{d.name}-q8_0.gguf")
        for which, heads in (("q", 4), ("k", 2)):  # [heads, head_dim] read back reversed; f32 even in q8_0
            norm = q8[f"blk.1.attn_{which}_norm.weight"]
            assert tuple(norm.shape) == (16, heads) and norm.tensor_type == gguf.GGMLQuantizationType.F32


def _without(monkeypatch, transform, replacement=IDENTITY):
    """Convert with every rule of `transform` using `replacement` instead (a negative control)."""
    original = convert_mod.family_for

    def patched(arch):
        fam = original(arch)
        rules = tuple(dataclasses.replace(r, transform=replacement) if r.transform is transform else r
                      for r in fam.tensors)
        return dataclasses.replace(fam, tensors=rules)

    monkeypatch.setattr(convert_mod, "family_for", patched)


def test_gemma_plus_one_matters(model, tmp_path, monkeypatch):
    """Negative control: Gemma's norms written as stored (w, not 1 + w) load and run, but compute another model."""
    _without(monkeypatch, PLUS_ONE)
    _, metrics, _ = convert_and_validate(model("gemma"), tmp_path / "gemma-no-plus-one.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 0.1


def test_gemma3_local_rope_base_matters(model, tmp_path, monkeypatch):
    """Negative control: without `rope.freq_base_swa` llama.cpp runs the sliding layers at its default base
    (10000, Gemma 3's own), so the model here slides at base 100. With the key the file is exact; without
    it, it diverges: the parity run really checks each layer's own rope."""
    d = copy_model(model("gemma3"), tmp_path / "gemma3-local-base-100")
    rope = json.loads((d / "config.json").read_text())["rope_parameters"]
    edit_config(d, rope_parameters={**rope, "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    _, metrics, _ = convert_and_validate(d, tmp_path / "gemma3-base-100.gguf", "f16")
    assert metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-3, metrics

    original = convert_mod.family_for

    def without_local_base(arch):
        fam = original(arch)
        return dataclasses.replace(fam, params=tuple(p for p in fam.params if p.key != gguf.Keys.Rope.FREQ_BASE_SWA))

    monkeypatch.setattr(convert_mod, "family_for", without_local_base)
    out = tmp_path / "gemma3-no-swa-base.gguf"
    _, metrics, _ = convert_and_validate(d, out, "f16")
    assert "gemma3.rope.freq_base_swa" not in FastGGUFReader(str(out)).fields
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 0.01, metrics


REFUSALS = [
    ("gemma", {"tie_word_embeddings": False}, r"llama.cpp's gemma uses token_embd as its output matrix"),
    ("gemma", {"hidden_act": "silu"}, r"gemma with activation 'silu' is not supported"),
    ("gemma2", {"query_pre_attn_scalar": 24}, r"gemma2 GGUF needs query_pre_attn_scalar == 32"),
    ("gemma2", {"attn_logit_softcapping": None}, r"gemma2 with attn_logit_softcapping=null is not supported"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, r"llama.cpp's gemma3 does not soft-cap attention"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}},
     r"gemma3 with a 'linear' rope on the sliding layers is not supported"),
    ("gemma3", {"use_bidirectional_attention": True}, r"an embedding model"),
    ("cohere", {"use_qk_norm": True}, r"command-r with use_qk_norm=true and 2 layers is not supported"),
    ("cohere", {"tie_word_embeddings": False}, r"llama.cpp's command-r uses token_embd as its output matrix"),
    ("olmo2", {"tie_word_embeddings": True}, r"llama.cpp's olmo2 needs its own output matrix"),
    ("olmo2", {"attention_bias": True}, r"llama.cpp's olmo2 has no attention biases"),
    ("stablelm", {"tie_word_embeddings": True}, r"llama.cpp's stablelm needs its own output matrix"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSALS])
def test_layouts_llama_cpp_cannot_run_are_refused(name, change, message, model, tmp_path):
    assert_refused(model(name), tmp_path, change, message, CASES[name][4])


def test_gemma3_multimodal_is_its_own_wrapper_family():
    """Gemma3ForConditionalGeneration is declared as a wrapper of the text family (families/gemma3_vlm.py: the same
    rules, the text weights under the wrapper's prefix; tested in test_gguf_families_vlm.py), not as Gemma 3 text."""
    from pipelines.targets.gguf.families import family_for

    assert family_for("Gemma3ForConditionalGeneration").name == "gemma3_vlm"
    assert family_for("Gemma3ForCausalLM").name == "gemma3"
    assert GgufTarget().supports(None, "Gemma3ForConditionalGeneration", {}, {})
    assert GgufTarget().supports(None, "Gemma3ForCausalLM", {}, {})


# StableLM 2 12B's per-head q/k norms: llama.cpp's converter (0.3.36) returns its stacking generator instead of
# yielding from it, so it drops them and refuses the model ("Unprocessed norms"); hive-aot stacks and validates them.
LLAMACPP_CASES = [c for c in CASES if c != "stablelm_12b"]


@pytest.mark.parametrize("name", LLAMACPP_CASES)
def test_same_tensors_as_llamacpp(name, model, tmp_path, llamacpp_tree):
    """f16 tensors byte-identical to llama.cpp's own converter on the same checkpoint (gguf_family_check; the
    vocabulary is held by the token-parity tests)."""
    assert_same_tensors_as_llamacpp(llamacpp_tree, model(name), tmp_path, tensors_only=True,
                                    options=CASES[name][4])
