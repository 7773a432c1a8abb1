"""GGUF families of dense Llama descendants: OLMo (1), OLMo 3 (declared with OLMo 2), Nemotron, SmolLM3, Arcee,
EXAONE 4.0, Seed-OSS and ERNIE 4.5, on tiny random models converted to f16 and q8_0 and validated in llama.cpp
against transformers fp32 (`gguf_family_check.check_family`), plus what is special to each family, negative
controls for the transforms and keys that matter, the layouts llama.cpp cannot run (refused in one line), and
the streamed reference of each new architecture against `from_pretrained`.

SmolLM2's BPE tokenizer cut to 2,048 tokens is copied into every model and each conversion names its pre-tokenizer
(`gguf_family_check`); transformers 5 reads the full tokenizer for all these model types with its generic class,
whose pre-tokenizer llama.cpp recognises by its hash (`test_full_smollm2_vocabulary_is_recognised`). Sliding
windows are 16 tokens, shorter than every parity prompt (85-133 tokens of the cut vocabulary), so they are exercised.
Nemotron's LayerNorm1P weights are shifted to around 0 as a trained model stores them (it scales by 1 + w;
transformers initialises w to 1, which doubles every norm and, with relu^2, makes a random model's logits so
sharp that q8_0 rounding alone costs KL 0.016).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, copy_model, edit_config, make_causal_lm
from gguf_family_check import (
    assert_full_vocab_recognised,
    assert_refused,
    assert_same_tensors_as_llamacpp,
    check_family,
    convert_and_validate,
    convert_only,
    field,
    replace_transforms,
    tensors,
    without_keys,
)
from gguf_reader import FastGGUFReader

from pipelines.targets.gguf import convert as convert_mod
from pipelines.targets.gguf.families import shared as shared_blocks
from pipelines.targets.gguf.families.shared import PERMUTE_K, PERMUTE_Q
from pipelines.targets.gguf.families.spec import IDENTITY, PLUS_ONE

VOCAB = SMALL_BPE_VOCAB  # SmolLM2's tokenizer cut to 2,048 tokens (gguf_family_check)
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# name: (config class, model class, config, gguf arch, build options)
CASES = {
    # tied like OLMo-1B; a clip small enough to bite on random projections (values beyond +-2 are common)
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(TINY, clip_qkv=2.0, tie_word_embeddings=True), "olmo", {}),
    # transformers' default layer_types for 4 layers: three sliding, then a full one
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(TINY, num_hidden_layers=4, sliding_window=16), "olmo2", {}),
    # every optional bias on; seed 1: seed 0's random logits sit at near-ties (f16 top-1 0.990 at KL 2.5e-6)
    "nemotron": ("NemotronConfig", "NemotronForCausalLM",
                 dict(TINY, hidden_act="relu2", attention_bias=True, mlp_bias=True), "nemotron",
                 {"seed": 1, "center_norms": True}),
    # 4 layers: layer 3 is a NoPE layer; seed 1: seed 0's random logits sit at near-ties (f16 top-1 0.984 at KL 1.5e-5)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(TINY, num_hidden_layers=4, tie_word_embeddings=True),
                "smollm3", {"seed": 1}),
    # Llama 3.1 frequency scaling at a 64-token original context, so the rope_freqs tensor acts on the prompts
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(TINY, rope_parameters=LLAMA3_ROPE), "arcee", {}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM",
                dict(TINY, sliding_window=None, layer_types=["full_attention"] * 2), "exaone4", {}),
    # head_dim 32 with hidden 64 / 4 heads (16): Seed-OSS sets its own
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(TINY, head_dim=32), "seed_oss", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(TINY, head_dim=32, tie_word_embeddings=True),
                 "ernie4_5", {}),
    # llama.cpp's exaone4 slides only at 64 layers (the 32B): the pattern LLLG, the rope on sliding layers only
    "exaone4_64": ("Exaone4Config", "Exaone4ForCausalLM",
                   dict(TINY, num_hidden_layers=64, sliding_window=16, sliding_window_pattern=4), "exaone4", {}),
}
FAMILY_CASES = [c for c in CASES if c != "exaone4_64"]


def _center_norms(model_dir: Path) -> None:
    """Norm weights w of a 1 + w model moved from around 1 to around 0 (as a trained Nemotron stores them)."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    for name in weights:
        if "norm" in name and name.endswith(".weight"):
            weights[name] = weights[name] - np.float32(1.0)
    save_file(weights, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-dense-models")

    def build(name: str) -> Path:
        if name not in built:
            cfg_cls, model_cls, params, _, opts = CASES[name]
            d = make_causal_lm(cfg_cls, model_cls, params, root / name, tokenizer_dir=smollm2_small_vocab_dir,
                               seed=opts.get("seed", 0))
            if opts.get("center_norms"):
                _center_norms(d)
            built[name] = d
        return built[name]

    return build


def shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest first; numpy order here


# --- parity (issue 11's bar) and what each family writes ------------------------------------------

def assert_specifics(name: str, path: Path) -> None:
    """What is special to each family, read back from the f16 file."""
    r = FastGGUFReader(str(path))
    t = {x.name: x for x in r.tensors}
    a = field(r, "general.architecture")
    if name == "olmo":
        assert not [n for n in t if "norm" in n]  # non-parametric LayerNorms: no norm tensor at all
        assert field(r, "olmo.attention.layer_norm_epsilon") == pytest.approx(1e-5)
        assert "olmo.attention.layer_norm_rms_epsilon" not in r.fields
        assert field(r, "olmo.attention.clamp_kqv") == pytest.approx(2.0)
        assert "output.weight" not in t  # tied: llama.cpp reuses token_embd
    elif name == "olmo3":
        assert field(r, "olmo2.attention.sliding_window") == 16
        assert list(field(r, "olmo2.attention.sliding_window_pattern")) == [True, True, True, False]
        assert field(r, "olmo2.rope.freq_base") == pytest.approx(5e5)
        assert "olmo2.rope.freq_base_swa" not in r.fields  # llama.cpp's olmo2 graph uses the global base
        assert shape(t["blk.0.attn_q_norm.weight"]) == (64,) and shape(t["blk.0.attn_k_norm.weight"]) == (32,)
    elif name == "nemotron":
        assert field(r, "nemotron.rope.dimension_count") == 8  # transformers' default factor 0.5 of head_dim 16
        assert field(r, "nemotron.attention.layer_norm_epsilon") == pytest.approx(1e-5)
        assert "nemotron.attention.layer_norm_rms_epsilon" not in r.fields
        assert {"output_norm.bias", "blk.0.attn_norm.bias", "blk.0.ffn_norm.bias", "blk.0.attn_q.bias",
                "blk.0.attn_output.bias", "blk.1.ffn_up.bias", "blk.1.ffn_down.bias", "output.weight"} <= set(t)
        assert "blk.0.ffn_gate.weight" not in t
        # stored around 0, written as 1 + w
        assert 0.9 < float(np.asarray(t["blk.0.attn_norm.weight"].data).mean()) < 1.1
    elif name == "smollm3":
        assert "output.weight" not in t and "rope_freqs.weight" not in t
        assert field(r, "smollm3.rope.dimension_count") == 16
    elif name == "arcee":
        assert shape(t["rope_freqs.weight"]) == (8,)  # head_dim / 2 factors
        freqs = np.asarray(t["rope_freqs.weight"].data)
        assert freqs[0] == 1.0 and freqs[-1] == pytest.approx(8.0)
        assert "blk.0.ffn_gate.weight" not in t and "output.weight" in t
    elif name == "exaone4":
        assert shape(t["blk.0.attn_q_norm.weight"]) == (16,) and shape(t["blk.0.attn_k_norm.weight"]) == (16,)
        assert {"blk.1.post_attention_norm.weight", "blk.1.post_ffw_norm.weight"} <= set(t)
        assert "blk.0.attn_norm.weight" not in t and "blk.0.ffn_norm.weight" not in t
        assert "exaone4.attention.sliding_window" not in r.fields
    elif name == "exaone4_64":
        assert field(r, "exaone4.attention.sliding_window") == 16
        assert list(field(r, "exaone4.attention.sliding_window_pattern")) == [(i + 1) % 4 != 0 for i in range(64)]
    elif name == "seed_oss":
        assert field(r, "seed_oss.attention.key_length") == 32 and field(r, "seed_oss.attention.value_length") == 32
        assert shape(t["blk.0.attn_q.weight"]) == (128, 64) and shape(t["blk.0.attn_output.weight"]) == (64, 128)
        assert {"blk.0.attn_q.bias", "blk.0.attn_v.bias", "blk.0.post_attention_norm.weight"} <= set(t)
        assert "blk.0.ffn_norm.weight" not in t and "blk.0.attn_output.bias" not in t
    elif name == "ernie4_5":
        assert field(r, f"{a}.attention.key_length") == 32
        assert shape(t["blk.0.attn_q.weight"]) == (128, 64)
        assert "output.weight" not in t  # tied by default
    else:
        raise AssertionError(f"no specifics for {name}")


# one case per config class: transformers picks the tokenizer class by model type
FULL_VOCAB_CASES = {case[0]: case[2] for case in reversed(CASES.values())}


@pytest.mark.parametrize("config_class", sorted(FULL_VOCAB_CASES))
def test_full_smollm2_vocabulary_is_recognised(config_class, smollm2_dir, tmp_path):
    """The cut vocabulary's conversions name the pre-tokenizer; the full one needs no name, for each model type."""
    params = {k: v for k, v in FULL_VOCAB_CASES[config_class].items() if v is not None}
    assert_full_vocab_recognised(config_class, params, smollm2_dir, tmp_path)


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_family_parity(name, model, tmp_path):
    """One case per family: f16 and q8_0 against transformers (check_family), then the family's specifics."""
    d = model(name)
    results = check_family(d, tmp_path, CASES[name][3])
    assert results["f16"][0].architecture == json.loads((d / "config.json").read_text())["architectures"][0]
    assert_specifics(name, tmp_path / f"{d.name}-f16.gguf")


def test_exaone4_sliding_windows_at_64_layers(model, tmp_path):
    """llama.cpp's exaone4 runs sliding windows only for 64 layers: f16 parity there (about 15 s with the build)."""
    d = model("exaone4_64")
    out = tmp_path / "exaone4-64.gguf"
    _, metrics, details = convert_and_validate(d, out, "f16")
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0, details["tokenizer_mismatches"]
    assert metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-3, metrics
    assert_specifics("exaone4_64", out)


# --- negative controls: the transforms and keys matter -----------------------------------------------

def _llama_permuted(monkeypatch) -> None:
    """Q and K permuted as for Llama's rope although these families' HF layout already is llama.cpp's."""
    permute = {"blk.{bid}.attn_q.weight": PERMUTE_Q, "blk.{bid}.attn_k.weight": PERMUTE_K}
    replace_transforms(monkeypatch, lambda r: permute.get(r.outputs[0]))


def _unpermuted(monkeypatch) -> None:
    monkeypatch.setattr(shared_blocks, "permute_qk", lambda w, n_head: w)


def _without_plus_one(monkeypatch) -> None:
    replace_transforms(monkeypatch, lambda r: IDENTITY if r.transform is PLUS_ONE else None)


def _without_rope_freqs(monkeypatch) -> None:
    original = convert_mod.family_for
    monkeypatch.setattr(convert_mod, "family_for",
                        lambda arch: dataclasses.replace(original(arch), extra_tensors=lambda hp: {}))


# control: (case, what goes wrong)
NEGATIVE = {
    "olmo-no-clamp": ("olmo", without_keys("{arch}.attention.clamp_kqv")),  # llama.cpp would not clip q/k/v
    "olmo3-no-window": ("olmo3", without_keys("{arch}.attention.sliding_window",
                                               "{arch}.attention.sliding_window_pattern")),
    "nemotron-no-plus-one": ("nemotron", _without_plus_one),  # LayerNorm1P's 1 + w written as w
    # llama's rope wants adjacent pairs; the NoPE layer does not care, the others do
    "smollm3-unpermuted": ("smollm3", _unpermuted),
    "arcee-no-rope-freqs": ("arcee", _without_rope_freqs),  # Llama 3.1 scaling dropped
    "exaone4-permuted": ("exaone4", _llama_permuted),
    "seed_oss-permuted": ("seed_oss", _llama_permuted),
    # Ernie's pairs are already adjacent: permuting them as Llama's breaks it
    "ernie4_5-permuted": ("ernie4_5", _llama_permuted),
}


@pytest.mark.parametrize("control", list(NEGATIVE))
def test_negative_control(control, model, tmp_path, monkeypatch):
    """The file loads and runs, and only parity shows it computes another model."""
    name, apply = NEGATIVE[control]
    apply(monkeypatch)
    _, metrics, _ = convert_and_validate(model(name), tmp_path / f"{control}.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 0.05, metrics  # 50x the f16 bar
    assert metrics["top1_agreement"] < 0.9, metrics


# --- layouts llama.cpp cannot run: refused in one line -----------------------------------------------

SLIDING_LINEAR = {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                  "sliding_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}
REFUSED = [
    ("olmo", {"attention_bias": True}, "olmo with attention_bias=true is not supported"),
    ("olmo", {"hidden_act": "gelu"}, "olmo with activation 'gelu' is not supported"),
    ("olmo", {"rope_parameters": LLAMA3_ROPE}, "rope scaling type 'llama3' is not supported for olmo GGUF"),
    ("olmo3", {"rope_parameters": SLIDING_LINEAR}, "olmo2 with a 'linear' rope on the sliding layers"),
    ("olmo3", {"tie_word_embeddings": True}, "llama.cpp's olmo2 needs its own output matrix"),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"olmo2 with sliding layers at rope base 10000.0 and full layers at 500000.0 is not supported"),
    # an old-style config: transformers 5 runs its sliding layers at 500000, transformers 4 at rope_theta
    ("olmo3", {"rope_parameters": None, "rope_theta": 1e4},
     r"olmo2 with sliding layers at rope base 500000.0 and full layers at 10000.0 is not supported"),
    ("nemotron", {"tie_word_embeddings": True}, "llama.cpp's nemotron needs its own output matrix"),
    ("nemotron", {"hidden_act": "silu"}, "nemotron with activation 'silu' is not supported"),
    ("nemotron", {"head_dim": 32}, r"nemotron GGUF needs num_attention_heads x head_dim == hidden_size \(64\)"),
    ("smollm3", {"no_rope_layers": [1, 1, 1, 1]}, r"smollm3 GGUF needs no_rope_layers == \[1, 1, 1, 0\]"),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 16,
                 "layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
     "smollm3 with sliding-window layers is not supported"),
    ("smollm3", {"attention_bias": True}, "smollm3 with attention_bias=true is not supported"),
    ("smollm3", {"mlp_bias": True}, "smollm3 with mlp_bias=true is not supported"),
    ("smollm3", {"rope_parameters": LLAMA3_ROPE}, "rope scaling type 'llama3' is not supported for smollm3"),
    ("arcee", {"attention_bias": True}, "arcee with attention_bias=true is not supported"),
    ("arcee", {"mlp_bias": True}, "arcee with mlp_bias=true is not supported"),
    ("arcee", {"hidden_act": "silu"}, "arcee with activation 'silu' is not supported"),
    ("exaone4", {"sliding_window": 16}, "exaone4 with sliding_window=16 and 2 layers is not supported"),
    # no sliding_window key: transformers' default window (4096), so its full layers would have no rope
    ("exaone4", {"sliding_window": None}, "exaone4 with sliding_window=4096 and 2 layers is not supported"),
    ("exaone4", {"num_hidden_layers": 64}, "exaone4 with 64 layers and sliding_window=null is not supported"),
    ("exaone4", {"head_dim": 32}, r"exaone4 GGUF needs num_attention_heads x head_dim == hidden_size"),
    ("seed_oss", {"attention_out_bias": True}, "seed_oss with attention_out_bias=true is not supported"),
    ("seed_oss", {"mlp_bias": True}, "seed_oss with mlp_bias=true is not supported"),
    ("ernie4_5", {"use_bias": True}, "ernie4_5 with use_bias=true is not supported"),
    ("ernie4_5", {"rope_parameters": LLAMA3_ROPE}, "rope scaling type 'llama3' is not supported for ernie4_5"),
]


@pytest.mark.parametrize("name,change,message", REFUSED, ids=[f"{n}-{next(iter(c))}" for n, c, _ in REFUSED])
def test_unsupported_layout_is_refused(name, change, message, model, tmp_path):
    assert_refused(model(name), tmp_path, change, message)


@pytest.mark.parametrize("name", ["smollm3", "ernie4_5"])
def test_tied_by_default(name, model, tmp_path):
    """SmolLM3 and ERNIE 4.5 tie their embeddings unless the config says otherwise: a config without the key
    is converted tied (no output matrix; llama.cpp reuses token_embd), as transformers loads it."""
    d = copy_model(model(name), tmp_path / name)
    edit_config(d, tie_word_embeddings=None)  # removes the key
    assert "tie_word_embeddings" not in json.loads((d / "config.json").read_text())
    out = tmp_path / "tied.gguf"
    convert_only(d, out)
    assert "output.weight" not in tensors(out) and "token_embd.weight" in tensors(out)


# --- the reference: streamed == from_pretrained -----------------------------------------------------

@pytest.mark.parametrize("name", FAMILY_CASES)
def test_streamed_reference_equals_from_pretrained(name, model):
    import torch

    from pipelines.model.streamed_model import StreamedCausalLM
    from pipelines.validation.reference import load_model

    d = model(name)
    ids = [1] + list(range(100, 160)) + [2]  # 62 tokens: past the 16-token sliding windows
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        streamed = lm.logits(ids)
    with torch.no_grad():
        expected = load_model(d)(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(streamed - expected).max() < 1e-4


EXAONE4_RELEASED = {
    # EXAONE-4.0-1.2B: 30 layers, global attention with the rope on every layer (sliding_window null)
    "1.2b": dict(architectures=["Exaone4ForCausalLM"], model_type="exaone4", hidden_size=2048, intermediate_size=4096,
                 num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=102400,
                 max_position_embeddings=65536, rms_norm_eps=1e-5, sliding_window=None, sliding_window_pattern=None,
                 layer_types=["full_attention"] * 30, tie_word_embeddings=True, hidden_act="silu",
                 rope_theta=1000000.0, rope_scaling=LLAMA3_ROPE),
    # EXAONE-4.0-32B: 64 layers, three sliding layers (window 4096, rope) then a global one without rope
    "32b": dict(architectures=["Exaone4ForCausalLM"], model_type="exaone4", hidden_size=5120, intermediate_size=27392,
                num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=102400,
                max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=4096, sliding_window_pattern="LLLG",
                tie_word_embeddings=False, hidden_act="silu", rope_theta=1000000.0, rope_scaling=LLAMA3_ROPE),
}


@pytest.mark.parametrize("size", list(EXAONE4_RELEASED))
def test_exaone4_released_layouts_are_what_llama_cpp_runs(size):
    """Both released sizes convert: llama.cpp's exaone4 slides (window 4096, pattern from the keys, rope on sliding
    layers only) exactly at 64 layers, which is the 32B's layout, and runs every other layer count with global
    attention and the rope everywhere, which is the 1.2B's (its config sets no window). A tiny model with the
    32B's features must keep its 64 layers (test_exaone4_sliding_windows_at_64_layers); fewer are refused."""
    from pipelines.targets.gguf.families import family_for
    from pipelines.targets.gguf.families.spec import HParams

    kv = family_for("Exaone4ForCausalLM").key_values(HParams(EXAONE4_RELEASED[size]))
    if size == "32b":
        assert kv["exaone4.attention.sliding_window"][0] == 4096
        assert kv["exaone4.attention.sliding_window_pattern"][0] == [(i + 1) % 4 != 0 for i in range(64)]
    else:
        assert "exaone4.attention.sliding_window" not in kv and kv["exaone4.block_count"][0] == 30


LLAMACPP_CASES = [c for c in CASES if c != "exaone4_64"]


@pytest.mark.parametrize("name", LLAMACPP_CASES)
def test_same_tensors_as_llamacpp(name, model, tmp_path, llamacpp_tree):
    """f16 tensors byte-identical to llama.cpp's own converter on the same checkpoint (gguf_family_check; the
    vocabulary is held by the token-parity tests)."""
    assert_same_tensors_as_llamacpp(llamacpp_tree, model(name), tmp_path, tensors_only=True)
