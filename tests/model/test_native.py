"""pipelines/model/native.py: the native stand-in for InternLM2 (a remote-code-only architecture), piece by piece.

The fused `wqkv` split is checked against a fuse written here from InternLM2's documented layout (grouped by KV
head), the config translation and the tensor mapping against InternLM2's own names written out by hand, and the
SentencePiece tokenizer against sentencepiece's own BOS/EOS options. End to end (the reference computes the
Llama the repository was made from, llama.cpp agrees) is test_gguf_families_internlm2.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from factories import spm_corpus

from pipelines.core.errors import ModelFormatError
from pipelines.model.native import (
    EQUIVALENTS,
    SentencePieceTokenizer,
    checkpoint_source,
    equivalent_for,
    native_config,
    read_config,
    split_internlm2_wqkv,
)

HEADS, KV, HEAD_DIM, HIDDEN = 8, 2, 4, 32


def fuse_grouped(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """InternLM2's layout, written independently: for each KV head g, its query heads, then key head g, then value
    head g."""
    d, per_group = q.shape[0] // n_head, n_head // n_kv
    rows = []
    for g in range(n_kv):
        for j in range(per_group):
            rows.append(q[(g * per_group + j) * d:(g * per_group + j + 1) * d])
        rows += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return np.concatenate(rows)


def random_qkv(seed: int = 0, cols: int = HIDDEN):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((HEADS * HEAD_DIM, cols)).astype(np.float32),
            rng.standard_normal((KV * HEAD_DIM, cols)).astype(np.float32),
            rng.standard_normal((KV * HEAD_DIM, cols)).astype(np.float32))


def test_split_wqkv_undoes_the_grouped_fuse_on_numpy_and_torch():
    import torch

    q, k, v = random_qkv()
    fused = fuse_grouped(q, k, v, HEADS, KV)
    for got, want in zip(split_internlm2_wqkv(fused, HEADS, KV), (q, k, v)):
        assert np.array_equal(got, want)
    for got, want in zip(split_internlm2_wqkv(torch.from_numpy(fused), HEADS, KV), (q, k, v)):
        assert torch.equal(got, torch.from_numpy(want))
    # the flat [q; k; v] layout (Phi-3's) is not what InternLM2 stores: splitting it as grouped mixes heads
    assert not np.array_equal(split_internlm2_wqkv(np.concatenate([q, k, v]), HEADS, KV)[0], q)


def test_split_wqkv_of_a_bias_vector():
    q, k, v = (x[:, 0] for x in random_qkv(1))
    fused = fuse_grouped(q[:, None], k[:, None], v[:, None], HEADS, KV)[:, 0]
    got = split_internlm2_wqkv(fused.reshape(-1, 1), HEADS, KV)
    assert all(np.array_equal(g.reshape(-1), w) for g, w in zip(got, (q, k, v)))


@pytest.mark.parametrize("rows,n_head,n_kv", [(HEADS * HEAD_DIM + 2 * KV * HEAD_DIM + 1, HEADS, KV),  # a row too many
                                              (48, 6, 4)])  # 6 query heads cannot share 4 KV heads
def test_split_wqkv_refuses_shapes_that_are_not_the_heads(rows, n_head, n_kv):
    with pytest.raises(ModelFormatError, match=rf"wqkv of {rows} rows does not hold {n_head} query and {n_kv} KV heads"):
        split_internlm2_wqkv(np.zeros((rows, HIDDEN), np.float32), n_head, n_kv)


# --- config.json ------------------------------------------------------------------------------------------------

def internlm2_config(**changes) -> dict:
    cfg = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
           "auto_map": {"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
           "bias": False, "hidden_act": "silu", "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "vocab_size": 700,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def write_config(d: Path, cfg) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_internlm2_config_becomes_a_llama_config(tmp_path):
    config, eq = native_config(write_config(tmp_path / "m", internlm2_config()))
    assert eq is EQUIVALENTS["InternLM2ForCausalLM"]
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (HIDDEN, 64, 2, HEADS, KV, 700)
    assert (config.rms_norm_eps, config.tie_word_embeddings, config.bos_token_id, config.eos_token_id) == (1e-6, False, 1, 2)
    assert config.attention_bias is False and config.mlp_bias is False
    assert config.rope_parameters["rope_theta"] == 1000000.0
    assert not (tmp_path / "m" / "modeling_internlm2.py").exists()  # nothing to run, nothing was looked for


def test_internlm2_config_translations(tmp_path):
    # no num_key_value_heads: multi-head attention, one KV head per query head
    config, _ = native_config(write_config(tmp_path / "mha", internlm2_config(num_key_value_heads=None)))
    assert config.num_key_value_heads == HEADS
    # InternLM2's single `bias` switch puts biases on the attention projections, never on the MLP
    config, _ = native_config(write_config(tmp_path / "bias", internlm2_config(bias=True)))
    assert config.attention_bias is True and config.mlp_bias is False
    # both spellings of the scaling type (InternLM2's `type`, transformers' `rope_type`)
    for i, scaling in enumerate(({"type": "linear", "factor": 2}, {"rope_type": "dynamic", "factor": 4.0})):
        config, _ = native_config(write_config(tmp_path / f"rope{i}", internlm2_config(rope_scaling=scaling)))
        assert config.rope_parameters["rope_type"] == (scaling.get("type") or scaling.get("rope_type"))
        assert config.rope_parameters["factor"] == float(scaling["factor"])


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": {"type": "ntk", "factor": 2.0}}, "InternLM2 rope_scaling .* is not linear or dynamic"),
    ({"rope_scaling": "linear"}, "InternLM2 rope_scaling 'linear' is not linear or dynamic"),
    # the head count decides the wqkv layout: without it nothing can be split (the other sizes, like transformers'
    # own configs, take the Llama defaults and meet the checkpoint's shapes in the streamed model's check)
    ({"num_attention_heads": None}, r"config.json has no num_attention_heads \(needed for InternLM2ForCausalLM\)"),
])
def test_internlm2_configs_that_cannot_be_translated_are_one_line(tmp_path, changes, message):
    with pytest.raises(ModelFormatError, match=message) as err:
        native_config(write_config(tmp_path / "m", internlm2_config(**changes)))
    assert "\n" not in str(err.value)


def test_a_config_without_an_equivalent_is_its_own(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 48, "num_attention_heads": 4,
           "num_hidden_layers": 1, "intermediate_size": 96, "vocab_size": 100}
    config, eq = native_config(write_config(tmp_path / "m", cfg))
    assert eq is None and config.hidden_size == 48 and config.model_type == "llama"


@pytest.mark.parametrize("archs", [None, [], "InternLM2ForCausalLM", [7], ["internlm2forcausallm"], ["LlamaForCausalLM"]])
def test_only_the_declared_architecture_has_an_equivalent(archs):
    assert equivalent_for({"architectures": archs} if archs is not None else {}) is None
    assert equivalent_for({"architectures": ["InternLM2ForCausalLM", "Other"]}) is EQUIVALENTS["InternLM2ForCausalLM"]


@pytest.mark.parametrize("content,message", [
    (b"{\"hidden_size\": ", "config.json cannot be read: JSONDecodeError"),
    (b"\xff\xfe{}", "config.json cannot be read: UnicodeDecodeError"),
    (b"[" * 100000 + b"]" * 100000, "config.json cannot be read: RecursionError"),
    (b"[\"InternLM2ForCausalLM\"]", "config.json is not an object"),
    (None, "config.json cannot be read: FileNotFoundError"),
])
def test_malformed_config_json_is_one_line(tmp_path, content, message):
    if content is not None:
        (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ModelFormatError, match=f"^{re.escape(message)}") as err:
        read_config(tmp_path)
    assert "\n" not in str(err.value)


# --- the tensor mapping ------------------------------------------------------------------------------------------

def internlm2_checkpoint_names(layers: int) -> set[str]:
    """InternLM2's own tensor names (its modeling_internlm2.py), written out by hand."""
    names = {"model.tok_embeddings.weight", "model.norm.weight", "output.weight"}
    for i in range(layers):
        names |= {f"model.layers.{i}.{n}.weight" for n in (
            "attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
            "attention_norm", "ffn_norm")}
    return names


def test_every_native_parameter_comes_from_an_internlm2_tensor(tmp_path):
    """Every parameter of the transformers Llama the config becomes is read from a tensor InternLM2 checkpoints
    have, the checkpoint's tensors are all used, and q/k/v take their rows of the fused wqkv."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = internlm2_config()
    config, eq = native_config(write_config(tmp_path / "m", cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sources = {name: checkpoint_source(eq, name, cfg) for name, _ in model.named_parameters()}
    assert None not in sources.values(), [n for n, s in sources.items() if s is None]
    assert {s for s, _ in sources.values()} == internlm2_checkpoint_names(2)
    assert sources["model.layers.1.mlp.gate_proj.weight"] == ("model.layers.1.feed_forward.w1.weight", None)
    assert sources["model.layers.1.mlp.up_proj.weight"] == ("model.layers.1.feed_forward.w3.weight", None)
    assert sources["lm_head.weight"] == ("output.weight", None)

    q, k, v = random_qkv(2)
    fused = fuse_grouped(q, k, v, HEADS, KV)
    for which, want in zip("qkv", (q, k, v)):
        source, take = sources[f"model.layers.0.self_attn.{which}_proj.weight"]
        assert source == "model.layers.0.attention.wqkv.weight" and np.array_equal(take(fused), want)
    # biases (InternLM2's `bias: true`) come from the fused bias the same way
    qb, kb, vb = (x[:, 0] for x in random_qkv(3))
    source, take = checkpoint_source(eq, "model.layers.0.self_attn.k_proj.bias", cfg)
    assert source == "model.layers.0.attention.wqkv.bias"
    assert np.array_equal(take(fuse_grouped(qb[:, None], kb[:, None], vb[:, None], HEADS, KV)[:, 0]), kb)
    assert checkpoint_source(eq, "model.rotary_emb.inv_freq", cfg) is None  # not a checkpoint tensor


# --- the SentencePiece tokenizer ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> bytes:
    from pipelines.model.synthetic import train_spm

    return train_spm(spm_corpus(lines=1500), 500, add_dummy_prefix=True)


def spm_repo(root: Path, proto: bytes, tokenizer_config: dict | bytes | None = None) -> Path:
    root.mkdir(parents=True)
    (root / "tokenizer.model").write_bytes(proto)
    if tokenizer_config is not None:
        raw = tokenizer_config if isinstance(tokenizer_config, bytes) else json.dumps(tokenizer_config).encode()
        (root / "tokenizer_config.json").write_bytes(raw)
    return root


TEXTS = ["The quick brown fox, 12345.", "  two leading spaces", "naïve café 中文 🚀", ""]


def test_encode_is_sentencepiece_with_bos_in_front(tmp_path, spm_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=spm_model)
    tok = SentencePieceTokenizer(spm_repo(tmp_path / "m", spm_model))  # no tokenizer_config: InternLM2's defaults
    for text in TEXTS:
        assert tok.encode(text) == sp.encode(text, add_bos=True)
        assert tok(text).input_ids == sp.encode(text, add_bos=True)
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    assert tok.decode(ids) == TEXTS[0]
    assert (tok.bos_token_id, tok.eos_token_id) == (sp.bos_id(), sp.eos_id())
    vocab = tok.get_vocab()
    assert len(vocab) == sp.get_piece_size() and vocab[sp.id_to_piece(100)] == 100


def test_tokenizer_config_switches_bos_and_eos(tmp_path, spm_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=spm_model)
    tok = SentencePieceTokenizer(spm_repo(tmp_path / "m", spm_model, {"add_bos_token": False, "add_eos_token": True}))
    assert tok.encode(TEXTS[0]) == sp.encode(TEXTS[0], add_bos=False, add_eos=True)


@pytest.mark.parametrize("config,message", [(b"{\"add_bos_token\": tr", "tokenizer_config.json cannot be read: JSONDecodeError"),
                                            (b"\xff\xfe", "tokenizer_config.json cannot be read: UnicodeDecodeError")])
def test_malformed_tokenizer_config_is_one_line(tmp_path, spm_model, config, message):
    with pytest.raises(ModelFormatError, match=f"^{message}"):
        SentencePieceTokenizer(spm_repo(tmp_path / "m", spm_model, config))


def test_a_missing_tokenizer_model_is_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelFormatError, match=r"^tokenizer.model is missing"):
        SentencePieceTokenizer(tmp_path / "m")


def test_the_reference_tokenizes_internlm2_with_sentencepiece_not_its_remote_class(tmp_path, spm_model):
    """The repository's tokenizer class is remote code (a tripwire here): the reference never imports it."""
    import sentencepiece

    from pipelines.validation.reference import load_tokenizer

    repo = spm_repo(tmp_path / "internlm2", spm_model, {
        "tokenizer_class": "InternLM2Tokenizer", "add_bos_token": True,
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]}})
    write_config(repo, internlm2_config(vocab_size=500))
    (repo / "tokenization_internlm2.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('REMOTE_CODE_RAN').write_text('yes')\n")
    tok = load_tokenizer(repo)
    assert isinstance(tok, SentencePieceTokenizer)
    sp = sentencepiece.SentencePieceProcessor(model_proto=spm_model)
    assert tok(TEXTS[0]).input_ids == sp.encode(TEXTS[0], add_bos=True)
    assert not (repo / "REMOTE_CODE_RAN").exists()
