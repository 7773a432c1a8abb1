"""Our HF -> GGUF converter against the transformers fp32 reference, on tiny but real models.

Every parity test converts a 2-layer model, loads the GGUF in llama.cpp and compares logits with
transformers on the same token ids (`validate_gguf`). Negative controls show the metrics do fail
when the conversion is wrong (no Q/K permutation, no rope_freqs), so the thresholds mean something.

The variants run on SmolLM2's BPE cut to 2,048 tokens (`smollm2_small_vocab_dir`: a tiny model's weights,
logits and GGUF vocabulary are otherwise almost all vocabulary) and name its pre-tokenizer
(`bpe_pre_fallback`); the full 49,152-token vocabulary, recognised by its check hash, is converted and
checked in the tied-Llama parity test, the metadata test, the NaN-embedding build and the error tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, SMOLLM2_PRE, copy_model, edit_config, make_llama, make_spm_llama, rewrite_safetensors
from gguf_reader import FastGGUFReader

from pipelines.core.errors import ModelFormatError
from pipelines.engine.build import plan
from pipelines.source.fetch import fetch
from pipelines.targets.gguf import convert as convert_mod
from pipelines.targets.gguf.convert import convert
from pipelines.targets.gguf.families import llama as llama_family, qwen2 as qwen2_family, shared as shared_blocks
from pipelines.targets.gguf.families.spec import IDENTITY
from pipelines.targets.gguf.validate import validate_gguf

Q = gguf.GGMLQuantizationType


# --- helpers ---------------------------------------------------------------------------------------

def run_convert(model_dir: Path, out: Path, outtype: str = "f16", options: dict | None = None):
    """`options` default: the cut vocabulary's pre-tokenizer named where the model has it (none otherwise)."""
    snap = fetch(str(model_dir), f"test/{model_dir.name}")
    cfg = snap.config()
    if options is None and cfg.get("vocab_size") == SMALL_BPE_VOCAB:
        options = {"bpe_pre_fallback": SMOLLM2_PRE}
    report = convert(snap.dir, cfg, snap.safetensors_files(), out, outtype, name=snap.model_id, options=options)
    return snap, report


def convert_and_validate(model_dir: Path, out: Path, outtype: str = "f16", options: dict | None = None):
    snap, report = run_convert(model_dir, out, outtype, options)
    metrics, details = validate_gguf(snap, out)
    print(f"{model_dir.name} {outtype}: {metrics}")
    return report, metrics, details


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def tensor_types(reader: gguf.GGUFReader) -> dict[str, Q]:
    return {t.name: t.tensor_type for t in reader.tensors}


def assert_f16_parity(metrics: dict, *, min_top1: float = 0.98) -> None:
    """Lossless-ish conversion: KL is the sharp measure; top-1 of a random tiny model can flip on near-ties."""
    assert metrics["finite"] is True
    assert metrics["positions"] > 200
    assert metrics["top1_agreement"] >= min_top1, metrics
    assert metrics["mean_kl"] < 1e-4, metrics
    assert metrics["max_abs_logit_delta"] < 0.2, metrics
    assert metrics["token_parity"] == 1.0, metrics


@pytest.fixture(scope="module")
def model(smollm2_dir, smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) a tiny Llama variant by name, with the cut SmolLM2 vocabulary (`full_vocab`: the
    whole one)."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-convert-models")

    def build(name: str, full_vocab: bool = False, **kwargs) -> Path:
        if name not in built:
            built[name] = make_llama(root / name, smollm2_dir if full_vocab else smollm2_small_vocab_dir, **kwargs)
        return built[name]

    return build


@pytest.fixture(scope="module")
def small_llama(model) -> Path:
    """tiny_llama's weights' shapes (tied, hidden 64) on the cut vocabulary."""
    return model("tied")


def test_general_metadata_is_named_after_the_repository_not_the_snapshot_directory(tiny_llama, tmp_path):
    """A Hub snapshot lives in a directory named by its commit; llama.cpp, run on a download of the repo, sees
    the repo's name. general.name / basename / finetune / size_label come from that name (gguf-py's own
    heuristics, as llama.cpp applies them), and the commit never leaks into them."""
    from pipelines.targets.gguf.convert import convert

    commit = "3f9a0c1d2e4b5a6978c0d1e2f3a4b5c6d7e8f901"
    d = tmp_path / commit
    shutil.copytree(tiny_llama, d)
    out = tmp_path / "named.gguf"
    cfg = json.loads((d / "config.json").read_text())
    report = convert(d, cfg, sorted(d.glob("*.safetensors")), out, "f16", name="SomeOrg/Cool-Model-7B-Instruct")
    r = FastGGUFReader(str(out))
    general = {k: field(r, k) for k in r.fields if k.startswith("general.") and k not in
               ("general.architecture", "general.file_type", "general.quantization_version", "general.type")}
    assert general["general.name"] == "Cool Model 7B Instruct"
    # what gguf-py's heuristics (llama.cpp's) make of a directory named after the repository
    named = tmp_path / "Cool-Model-7B-Instruct"
    named.mkdir()
    shutil.copy(d / "config.json", named / "config.json")
    expected = gguf.Metadata.load(None, named, None, report.parameters)
    assert general["general.basename"] == expected.basename == "Cool-Model"
    assert general["general.finetune"] == expected.finetune
    # the size label is the real parameter count's, not the name's claim
    assert general["general.size_label"] == f"{report.parameters / 1e6:.1f}M" != "7B"
    assert not any(commit[:8] in str(v) for v in general.values()), general
    assert report.metadata["name"] == "Cool Model 7B Instruct"


# --- parity ----------------------------------------------------------------------------------------

def test_tied_llama_f16_parity_and_metadata(tiny_llama, tmp_path):
    out = tmp_path / "tied-f16.gguf"
    report, metrics, details = convert_and_validate(tiny_llama, out)
    assert metrics["finite"] is True
    assert metrics["top1_agreement"] >= 0.99
    assert metrics["mean_kl"] < 1e-3
    assert metrics["token_parity"] == 1.0
    assert details["tokenizer_mismatches"] == []
    assert metrics["greedy_prefix_match"] >= 10

    assert report.architecture == "LlamaForCausalLM" and report.gguf_arch == "llama"
    assert report.vocab["pre"] == "smollm" and report.vocab["pre_detection"].startswith("hash:")
    assert report.tensor_types == {"F16": 15, "F32": 5}  # 2 layers x 7 matrices + token_embd; 5 norms

    r = FastGGUFReader(str(out))
    assert field(r, "general.architecture") == "llama"
    assert field(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    assert field(r, "llama.block_count") == 2
    assert field(r, "llama.embedding_length") == 64
    assert field(r, "llama.feed_forward_length") == 128
    assert field(r, "llama.attention.head_count") == 4
    assert field(r, "llama.attention.head_count_kv") == 2
    assert field(r, "llama.rope.dimension_count") == 16
    assert field(r, "llama.context_length") == 512
    assert field(r, "llama.vocab_size") == 49152
    assert field(r, "tokenizer.ggml.model") == "gpt2"
    assert field(r, "tokenizer.ggml.pre") == "smollm"
    assert len(field(r, "tokenizer.ggml.tokens")) == 49152
    assert len(field(r, "tokenizer.ggml.merges")) > 40000
    types = tensor_types(r)
    assert "output.weight" not in types  # tied: llama.cpp reuses token_embd
    assert "rope_freqs.weight" not in types
    assert types["token_embd.weight"] == Q.F16 and types["blk.1.attn_q.weight"] == Q.F16
    assert types["output_norm.weight"] == Q.F32 and types["blk.0.attn_norm.weight"] == Q.F32
    q = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    assert q.data.shape == (64, 64)


def test_untied_lm_head_becomes_output_weight(model, tmp_path):
    d = model("untied", tie=False)
    out = tmp_path / "untied.gguf"
    report, metrics, _ = convert_and_validate(d, out)
    assert_f16_parity(metrics)
    types = tensor_types(FastGGUFReader(str(out)))
    assert types["output.weight"] == Q.F16
    assert report.tensors == 21 and report.tensor_types == {"F16": 16, "F32": 5}
    # the lm_head really is a different matrix here, so output.weight cannot be a copy of token_embd
    r = FastGGUFReader(str(out))
    data = {t.name: np.asarray(t.data) for t in r.tensors}
    assert not np.array_equal(data["output.weight"], data["token_embd.weight"])


def test_mistral(model, tmp_path):
    d = model("mistral", arch="MistralForCausalLM")
    assert json.loads((d / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    out = tmp_path / "mistral.gguf"
    report, metrics, _ = convert_and_validate(d, out)
    assert_f16_parity(metrics)
    assert report.architecture == "MistralForCausalLM"
    assert field(FastGGUFReader(str(out)), "general.architecture") == "llama"


@pytest.fixture(scope="module")
def bias_model(model):
    """attention_bias=True; transformers initializes biases to zero, so make them random (and large)."""
    d = model("attention-bias", attention_bias=True)
    rng = np.random.default_rng(0)

    def randomize(tensors):
        for name in tensors:
            if name.endswith(".bias"):
                tensors[name] = rng.normal(0.0, 1.0, tensors[name].shape).astype(np.float32)

    rewrite_safetensors(d, randomize)
    return d


def test_attention_bias(bias_model, tmp_path):
    out = tmp_path / "bias.gguf"
    report, metrics, _ = convert_and_validate(bias_model, out)
    assert_f16_parity(metrics)
    types = tensor_types(FastGGUFReader(str(out)))
    for bid in range(2):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            assert types[f"blk.{bid}.{t}.bias"] == Q.F32


def test_attention_bias_needs_the_q_k_bias_permutation(bias_model, tmp_path, monkeypatch):
    """Negative control: weights permuted but q/k biases not -> parity collapses."""
    original = convert_mod.family_for

    def without_bias_permutation(arch):
        fam = original(arch)
        rules = tuple(dataclasses.replace(r, transform=IDENTITY) if r.outputs[0].endswith(".bias") else r
                      for r in fam.tensors)
        return dataclasses.replace(fam, tensors=rules)

    monkeypatch.setattr(convert_mod, "family_for", without_bias_permutation)
    _, metrics, _ = convert_and_validate(bias_model, tmp_path / "bias-unpermuted.gguf")
    assert metrics["top1_agreement"] < 0.5
    assert metrics["mean_kl"] > 0.1


def test_head_dim_differs_from_hidden_over_heads(model, tmp_path):
    d = model("head-dim-32", head_dim=32)  # hidden 64, 4 heads: hidden/heads would be 16
    out = tmp_path / "head-dim.gguf"
    _, metrics, _ = convert_and_validate(d, out)
    assert_f16_parity(metrics)
    r = FastGGUFReader(str(out))
    assert field(r, "llama.attention.key_length") == 32
    assert field(r, "llama.attention.value_length") == 32
    assert field(r, "llama.rope.dimension_count") == 32
    shapes = {t.name: tuple(t.data.shape) for t in r.tensors}
    assert shapes["blk.0.attn_q.weight"] == (4 * 32, 64)
    assert shapes["blk.0.attn_k.weight"] == (2 * 32, 64)
    assert shapes["blk.0.attn_output.weight"] == (64, 4 * 32)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # far below the ~100-token prompts, so the scaled frequencies are really used
               "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def llama3_model(model):
    return model("llama3-rope", rope_parameters={**LLAMA3_ROPE, "rope_theta": 10000.0})


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_llama3_rope_scaling(llama3_model, tmp_path, spelling):
    d = llama3_model
    if spelling == "rope_scaling":  # the transformers 4 spelling: rope_scaling + top-level rope_theta
        d = copy_model(llama3_model, tmp_path / "llama3-rope-scaling")
        edit_config(d, rope_parameters=None, rope_scaling=dict(LLAMA3_ROPE), rope_theta=10000.0)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg.get("rope_parameters") or cfg.get("rope_scaling"))["rope_type"] == "llama3"
    out = tmp_path / "llama3.gguf"
    report, metrics, _ = convert_and_validate(d, out)
    assert_f16_parity(metrics)
    r = FastGGUFReader(str(out))
    freqs = {t.name: np.asarray(t.data) for t in r.tensors}["rope_freqs.weight"]
    assert tensor_types(r)["rope_freqs.weight"] == Q.F32
    assert freqs.shape == (16 // 2,)
    # all three regimes of the llama3 rule occur: kept (1), fully scaled (factor) and smoothed in between
    assert freqs[0] == 1.0 and freqs[-1] == 8.0
    assert any(1.0 < f < 8.0 for f in freqs)
    assert report.tensor_types["F32"] == 6  # 5 norms + rope_freqs


def test_llama3_rope_freqs_matter(llama3_model, tmp_path, monkeypatch):
    """Negative control: the same model without rope_freqs diverges, so the scaling is really exercised."""
    original = convert_mod.family_for
    monkeypatch.setattr(convert_mod, "family_for",
                        lambda arch: dataclasses.replace(original(arch), extra_tensors=lambda hp: {}))
    out = tmp_path / "llama3-no-freqs.gguf"
    _, metrics, _ = convert_and_validate(llama3_model, out)
    assert "rope_freqs.weight" not in tensor_types(FastGGUFReader(str(out)))
    assert metrics["top1_agreement"] < 0.5
    assert metrics["mean_kl"] > 0.1


def test_q_k_permutation_matters(small_llama, tmp_path, monkeypatch):
    """Negative control: without llama.cpp's rotary pair layout the GGUF loads but is garbage."""
    monkeypatch.setattr(shared_blocks, "permute_qk", lambda w, n_head: w)
    _, metrics, _ = convert_and_validate(small_llama, tmp_path / "unpermuted.gguf")
    assert metrics["finite"] is True  # it loads and runs: only parity can catch this
    assert metrics["top1_agreement"] < 0.5
    assert metrics["mean_kl"] > 0.1


def test_q8_0_parity(small_llama, tmp_path):
    out = tmp_path / "q8.gguf"
    report, metrics, _ = convert_and_validate(small_llama, out, "q8_0")
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0
    assert metrics["top1_agreement"] >= 0.8
    assert metrics["mean_kl"] < 0.01
    assert report.tensor_types == {"Q8_0": 15, "F32": 5}
    r = FastGGUFReader(str(out))
    assert field(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert field(r, "general.quantization_version") == gguf.GGML_QUANT_VERSION
    assert tensor_types(r)["token_embd.weight"] == Q.Q8_0


def test_bf16_parity(small_llama, tmp_path):
    out = tmp_path / "bf16.gguf"
    report, metrics, _ = convert_and_validate(small_llama, out, "bf16")
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0
    assert metrics["top1_agreement"] >= 0.95
    assert metrics["mean_kl"] < 1e-3
    assert report.tensor_types == {"BF16": 15, "F32": 5}
    r = FastGGUFReader(str(out))
    assert field(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_BF16)
    # the source is bf16: a bf16 GGUF holds exactly the source bits
    from pipelines.source.safetensors_io import SafetensorsFile

    with SafetensorsFile(small_llama / "model.safetensors") as f:
        src = f.raw("model.layers.0.mlp.up_proj.weight").view(np.uint16).reshape(128, 64).copy()
    got = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    assert np.array_equal(np.asarray(got.data).view(np.uint16).reshape(128, 64), src)


def test_q4_k_m_through_the_target(smollm2_dir, tmp_path, config):
    """k-quants via libllama from a lossless intermediate; hidden 256 so Q4_K/Q6_K are really used."""
    from pipelines.targets.gguf import GgufTarget

    d = make_llama(tmp_path / "q4km-model", smollm2_dir, hidden_size=256, intermediate_size=512,
                   initializer_range=0.02)
    p = plan(str(d), "gguf-q4_k_m", config, "test/q4km-model")  # the context a target builds in
    assert isinstance(p.target, GgufTarget) and p.compatibility.hardware == "cpu"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = p.target
    art = target.build(p.context, out_dir)
    assert art.files == ["q4km-model-Q4_K_M.gguf"]
    assert sorted(p.name for p in out_dir.iterdir()) == art.files
    assert art.info["intermediate"] is None and art.info["outtype"] == "Q4_K_M"  # quantized as it streamed
    r = FastGGUFReader(str(out_dir / art.files[0]))
    assert field(r, "general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    counts = Counter(t.tensor_type for t in r.tensors)
    assert counts[Q.Q4_K] > 0 and counts[Q.Q6_K] > 0, counts
    assert all(t.tensor_type == Q.F32 for t in r.tensors if len(t.shape) == 1)
    rep = target.validate(p.context, out_dir, {f: "" for f in art.files})
    m = rep.metrics
    print(f"q4_k_m: {m} passed={rep.passed} {rep.failures}")
    assert m["finite"] is True and m["token_parity"] == 1.0
    assert m["top1_agreement"] >= 0.6  # measured 0.79 (random weights are hard on 4-bit)
    assert m["mean_kl"] < 0.02  # measured 0.0012


# --- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mutate,error", [
    (lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", np.ones((4, 4), np.float32)),
     r"unmapped tensors for llama: model\.layers\.0\.mlp\.extra_proj\.weight"),
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'.*blk\.1\.ffn_up\.weight"),
], ids=["unmapped-extra", "missing-required"])
def test_tensor_set_must_match_the_family(tiny_llama, tmp_path, mutate, error):
    """Planning refuses before anything is written: no GGUF file appears."""
    d = copy_model(tiny_llama, tmp_path / "m")
    rewrite_safetensors(d, mutate)
    out = tmp_path / "m.gguf"
    with pytest.raises(ModelFormatError, match=error):
        run_convert(d, out)
    assert not out.exists()


def test_untied_without_lm_head_is_refused(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "no-head")
    edit_config(d, tie_word_embeddings=False)
    with pytest.raises(ModelFormatError, match="lm_head.weight is missing and tie_word_embeddings is false"):
        run_convert(d, tmp_path / "no-head.gguf")


def test_embedding_rows_must_match_vocab_size(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "vocab-mismatch")
    edit_config(d, vocab_size=49152 + 64)
    out = tmp_path / "vocab-mismatch.gguf"
    with pytest.raises(ModelFormatError, match=r"embedding is \[49152, 64\], config says vocab_size=49216"):
        run_convert(d, out)
    assert not out.exists()


@pytest.fixture(scope="module")
def unknown_pre_model(tiny_llama, tmp_path_factory):
    """SmolLM2's tokenizer with two vocab ids swapped: a valid BPE tokenizer whose check hash is unknown."""
    from transformers import AutoTokenizer

    from pipelines.targets.gguf.vocab import _pre_table

    d = copy_model(tiny_llama, tmp_path_factory.mktemp("unknown-pre") / "model")
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = tok.encode(_pre_table()["check_text"])
    a, b = [i for i in dict.fromkeys(ids) if i not in tok.added_tokens_decoder][:2]
    spec = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[a]], vocab[by_id[b]] = b, a
    (d / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return d


def test_unknown_bpe_pre_tokenizer_is_an_error(unknown_pre_model, tmp_path):
    out = tmp_path / "unknown-pre.gguf"
    with pytest.raises(ModelFormatError,
                       match=r"BPE pre-tokenizer not recognised by llama\.cpp \(check hash [0-9a-f]{16}.*bpe_pre_fallback"):
        run_convert(unknown_pre_model, out)
    assert not out.exists()


def test_unknown_bpe_pre_tokenizer_explicit_fallback_is_recorded(unknown_pre_model, tmp_path):
    out = tmp_path / "fallback.gguf"
    _, report = run_convert(unknown_pre_model, out, options={"bpe_pre_fallback": "gpt-2"})
    assert report.vocab["pre"] == "gpt-2"
    assert report.vocab["pre_detection"].startswith("fallback:")
    assert field(FastGGUFReader(str(out)), "tokenizer.ggml.pre") == "gpt-2"


def _untouched_vocab_row(model_dir: Path) -> int:
    """The highest token id that no validation text, tokenizer text or generation prompt contains."""
    from transformers import AutoTokenizer

    from pipelines.validation import prompts

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [*prompts.PARITY_TEXTS, *prompts.TOKENIZER_TEXTS, prompts.GENERATION_PROMPT]
    used = {i for t in texts for i in tok(t).input_ids}
    return max(set(range(len(tok))) - used)


def test_nan_in_an_embedding_row_no_prompt_touches_is_refused_by_build(model, tmp_path):
    """Issue 7 item 2: logits never see this row (untied lm_head), so validation passed and the NaN was published."""
    from factories import write_test_config

    from pipelines.config.registry import Config
    from pipelines.engine.build import build_and_publish

    d = copy_model(model("untied-full-vocab", full_vocab=True, tie=False), tmp_path / "nan-embed")
    row = _untouched_vocab_row(d)

    def poison(tensors):
        tensors["model.embed_tokens.weight"][row, 7] = np.nan

    rewrite_safetensors(d, poison)
    tconfig = Config.load(write_test_config(tmp_path / "cfg", Path.cwd()))
    store = tmp_path / "store"
    with pytest.raises(ModelFormatError) as e:
        build_and_publish(str(d), "gguf-f16", tconfig, str(store), "test-org/nan-embed")
    assert str(e.value) == ("test-org/nan-embed: tensor model.embed_tokens.weight has 1 non-finite value(s) (NaN/Inf) "
                            f"out of {49152 * 64}; refusing to convert corrupt weights")
    assert "\n" not in str(e.value)
    assert not list(store.rglob("*.json"))  # nothing staged, nothing published


def test_inf_in_an_mlp_weight_is_refused_and_no_partial_file_is_left(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "inf")

    def poison(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.inf
        tensors["model.layers.1.mlp.up_proj.weight"][4, 6] = -np.inf

    rewrite_safetensors(d, poison)
    for outtype in ("f16", "q8_0"):
        out = tmp_path / f"inf-{outtype}.gguf"
        with pytest.raises(ModelFormatError, match=r"^test/inf: tensor model\.layers\.1\.mlp\.up_proj\.weight has 2 "
                                                   r"non-finite value\(s\) \(NaN/Inf\) out of 8192; refusing"):
            run_convert(d, out, outtype)
        assert not out.exists()  # the header and earlier tensors were already written: removed again


def test_values_beyond_float16_range_are_refused_for_f16_only(tiny_llama, tmp_path):
    """A finite bf16 weight of 1e5 would become +Inf in an f16 GGUF; bf16 and f32 hold it."""
    d = copy_model(tiny_llama, tmp_path / "big")

    def enlarge(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"][1, 2] = 1.0e5

    rewrite_safetensors(d, enlarge)
    out = tmp_path / "big-f16.gguf"
    with pytest.raises(ModelFormatError, match=r"^test/big: tensor model\.layers\.0\.mlp\.down_proj\.weight holds "
                                               r"values up to 1(\.\d+)?e\+05, beyond float16's range \(65504\)"):
        run_convert(d, out, "f16")
    assert not out.exists()
    run_convert(d, tmp_path / "big-bf16.gguf", "bf16")  # representable: converted
    assert (tmp_path / "big-bf16.gguf").stat().st_size > 0


def test_nan_blocks_the_kquant_intermediate_too(tiny_llama, tmp_path):
    """A k-quant (quantized as it streams, or through a lossless intermediate) is refused the same way, and leaves
    no partial file behind."""
    from pipelines.config.registry import Config
    from pipelines.targets.gguf import GgufTarget

    d = copy_model(tiny_llama, tmp_path / "nan-q4")

    def poison(tensors):
        tensors["model.norm.weight"][0] = np.nan

    rewrite_safetensors(d, poison)
    p = plan(str(d), "gguf-q4_k_m", Config.load(Path.cwd() / "registry.yaml"), "test/nan-q4")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ModelFormatError, match=r"tensor model\.norm\.weight has 1 non-finite"):
        GgufTarget().build(p.context, out_dir)
    assert list(out_dir.iterdir()) == []  # no partial GGUF (or intermediate) left behind


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": "linear"}, "config.json rope_scaling must be an object, not str"),
    ({"rope_parameters": ["rope_theta", 10000.0]}, "config.json rope_parameters must be an object, not list"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "config.json has a quantization_config"),
    ({"quantization_config": "yes"}, "config.json has a quantization_config"),
])
def test_config_the_converter_cannot_honour_is_one_line(tiny_llama, tmp_path, change, message):
    """`check` refuses these before a build; a direct convert() must not die on dict("linear") or read GPTQ as floats."""
    d = copy_model(tiny_llama, tmp_path / "m")
    edit_config(d, **change)
    out = tmp_path / "m.gguf"
    with pytest.raises(ModelFormatError, match=message):
        run_convert(d, out)
    assert not out.exists()


# --- streaming -------------------------------------------------------------------------------------
# The probe runs in a fresh process and reads the kernel's peak-RSS watermark (VmHWM), reset after a
# warm-up conversion. Not getrusage().ru_maxrss: in a child of pytest it starts at the parent's RSS
# (exec records the forked parent image's high-water mark; RUSAGE_THREAD too on this kernel) and the
# reset does not lower it, so a ~450 MB pytest process hides any growth below that.

_RSS_PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from pipelines.source.fetch import fetch
    from pipelines.source.safetensors_io import TensorSource
    from pipelines.targets.gguf import convert as C

    def status_kib(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    model_dir, out_dir, outtype, keep_pages = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    if keep_pages:  # counterfactual: what the probe sees when source pages are never released
        TensorSource.release = lambda self, name, lo=0, hi=None: None
    snap = fetch(str(model_dir), "test/streaming")
    args = (snap.dir, snap.config(), snap.safetensors_files())
    C.convert(*args, out_dir / "warmup.gguf", outtype, name="t")  # imports, vocab, lazy inits
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak-RSS watermark to its current RSS
    before = status_kib("VmHWM")
    C.convert(*args, out_dir / "measured.gguf", outtype, name="t")
    print(json.dumps({"before_kib": before, "after_kib": status_kib("VmHWM"), "rss_kib": status_kib("VmRSS")}))
""")


@pytest.fixture(scope="module")
def streaming_model(tmp_path_factory):
    """~89 MB of f32 weights whose largest tensor is 2 MiB (small SentencePiece vocab, 12 wide-MLP layers)."""
    return make_spm_llama(tmp_path_factory.mktemp("streaming") / "model", hidden_size=256, intermediate_size=2048,
                          num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=4, dtype="float32")


def _peak_growth(model_dir: Path, out_dir: Path, outtype: str, keep_pages: bool) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(model_dir), str(out_dir), outtype,
                           "1" if keep_pages else "0"], capture_output=True, text=True, timeout=300,
                          cwd=Path.cwd(), env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return (res["after_kib"] - res["before_kib"]) * 1024


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="peak-RSS reset needs /proc/self/clear_refs")
def test_conversion_streams_tensors(streaming_model, tmp_path):
    from pipelines.source.safetensors_io import read_header

    header = read_header(streaming_model / "model.safetensors")
    total = sum(t.nbytes for t in header.tensors.values())
    largest = max(t.nbytes for t in header.tensors.values())
    assert total > 80e6 and largest * 40 < total
    for outtype in ("f16", "q8_0"):
        growth = _peak_growth(streaming_model, tmp_path / outtype, outtype, keep_pages=False)
        print(f"{outtype}: peak RSS growth {growth / 2**20:.1f} MiB for {total / 2**20:.1f} MiB of weights "
              f"(largest tensor {largest / 2**20:.1f} MiB)")
        assert growth < total / 5, (outtype, growth, total)
    # the probe can fail: with the source pages left mapped, peak RSS grows to about the whole model
    kept = _peak_growth(streaming_model, tmp_path / "kept", "f16", keep_pages=True)
    print(f"f16 without page release: peak RSS growth {kept / 2**20:.1f} MiB")
    assert kept > total / 2


# --- Qwen2: Llama layout with q/k/v biases, NEOX rope (no permutation) ----------------------------

@pytest.fixture(scope="module")
def qwen2_model(smollm2_small_vocab_dir, tmp_path_factory):
    from factories import make_qwen2

    return make_qwen2(tmp_path_factory.mktemp("qwen2") / "tiny-qwen2", smollm2_small_vocab_dir)


def test_qwen2_f16_parity_and_metadata(qwen2_model, tmp_path):
    out = tmp_path / "qwen2.gguf"
    # transformers reads these tokenizer files as Qwen2Tokenizer, whose check hash llama.cpp does not
    # know for this vocabulary: the pre-tokenizer is named explicitly and recorded as a fallback.
    with pytest.raises(ModelFormatError, match="pre-tokenizer not recognised"):
        run_convert(qwen2_model, tmp_path / "no-fallback.gguf", options={})
    report, metrics, _ = convert_and_validate(qwen2_model, out, options={"bpe_pre_fallback": "qwen2"})
    assert_f16_parity(metrics)
    assert report.vocab["pre_detection"].startswith("fallback:")
    r = FastGGUFReader(str(out))
    assert field(r, "general.architecture") == "qwen2" and field(r, "tokenizer.ggml.pre") == "qwen2"
    assert field(r, "qwen2.block_count") == 2 and field(r, "qwen2.attention.head_count_kv") == 2
    assert tensor_types(r)["blk.0.attn_q.bias"] == Q.F32


def test_qwen2_must_not_be_permuted(qwen2_model, tmp_path, monkeypatch):
    """Negative control: Llama's Q/K permutation under the qwen2 architecture (NEOX rope) breaks it."""
    permuted = dataclasses.replace(qwen2_family.FAMILY, tensors=llama_family.FAMILY.tensors)
    monkeypatch.setattr(convert_mod, "family_for", lambda arch: permuted)
    _, metrics, _ = convert_and_validate(qwen2_model, tmp_path / "qwen2-permuted.gguf",
                                         options={"bpe_pre_fallback": "qwen2"})
    assert metrics["top1_agreement"] < 0.5


def test_gguf_py_warnings_about_templates_do_not_leak_to_stderr(small_llama, tmp_path):
    """Red team round two, item 20: gguf-py's SpecialVocab printed "Unknown separator token ... in
    TemplateProcessing<pair>" through Python's last-resort log handler around the build's one line."""
    import json
    import shutil
    import subprocess
    import sys

    d = tmp_path / "templated"
    shutil.copytree(small_llama, d)
    spec = json.loads((d / "tokenizer.json").read_text())
    start = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    seq = lambda x: {"Sequence": {"id": x, "type_id": 0}}  # noqa: E731
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [start, seq("A")],
                              "pair": [start, seq("A"), {"SpecialToken": {"id": "<repo_name>", "type_id": 0}}, seq("B")],
                              "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]}
                                                 for t, i in (("<|im_start|>", 1), ("<repo_name>", 3))}}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    # in its own process, as the CLI runs: pytest's log capture would otherwise swallow what would leak
    code = ("import json, sys; from pipelines.source.fetch import fetch; from pipelines.targets.gguf.convert import convert; "
            "from pathlib import Path; snap = fetch(sys.argv[1], 'test/templated'); "
            "convert(snap.dir, snap.config(), snap.safetensors_files(), "
            "Path(sys.argv[2]), 'f16', name=snap.model_id, options=json.loads(sys.argv[3]))")
    proc = subprocess.run([sys.executable, "-c", code, str(d), str(tmp_path / "out.gguf"),
                           json.dumps({"bpe_pre_fallback": SMOLLM2_PRE})], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "TemplateProcessing" not in proc.stderr and "Unknown separator" not in proc.stderr, proc.stderr
