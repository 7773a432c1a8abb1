"""Tokenizer -> GGUF vocabulary: SentencePiece (`llama`) and byte-level BPE (`gpt2` + pre-tokenizer).

SentencePiece models are trained here (BPE, byte fallback, Llama-2 settings), wrapped in HF tokenizer
files, put on a tiny Llama and converted; llama.cpp's token ids are compared with SentencePiece itself
and with transformers, and logits with the transformers fp32 reference.

Two documented differences are asserted exactly rather than hidden. transformers 5 rebuilds every
`LlamaTokenizer` with a non-legacy Metaspace pre-tokenizer (prepend_scheme "first") that adds the
dummy prefix (1) only when the text does not already start with a space (huggingface/transformers#47862)
and (2) only before the first segment, not after special tokens written in the text. SentencePiece
always adds it to the text; llama.cpp follows SentencePiece and, after special tokens, the legacy
Llama-2 tokenizer.json (a Prepend normalizer on every segment). No GGUF key expresses the Metaspace
rule, so there the converter matches the original tokenizer, not transformers 5.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import sentencepiece as spm
from factories import copy_model, make_spm_llama
from gguf_reader import FastGGUFReader

from pipelines.core.errors import ModelFormatError
from pipelines.source.fetch import fetch
from pipelines.targets.gguf.convert import convert
from pipelines.targets.gguf.validate import validate_gguf
from pipelines.targets.gguf.vocab import build_vocab
from pipelines.validation import prompts

T = gguf.TokenType

EXTRA_TEXTS = [
    "", " ", "x", " a", "  two leading", "trailing ", "\n", "\nstarts with a newline", "\ttab first",
    "Numbers 0 7 42 1999 3.5e-7 -12,345.678 and dates 2024-02-29.",
    "MiXeD CaSe WORDS and_snake_case and camelCaseWords",
    "tabs\t\tand\r\nwindows newlines\u00a0nbsp",
]
PLAIN_TEXTS = prompts.TOKENIZER_TEXTS + prompts.PARITY_TEXTS + EXTRA_TEXTS
# the SentencePiece control tokens written in the text: transformers and llama.cpp (special=True) parse
# them as tokens, SentencePiece itself as plain text
SPECIAL_TEXTS = ["<s> and </s> and <unk> written as text", "a</s>b", "a <s> b", "<s>x"]


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """Tiny Llamas on freshly trained SentencePiece vocabularies, converted to f16 (built once per variant)."""
    built: dict[tuple, tuple] = {}
    root = tmp_path_factory.mktemp("gguf-spm")

    def build(add_dummy_prefix: bool, hf_tokenizer: str, **overrides):
        key = (add_dummy_prefix, hf_tokenizer, tuple(sorted(overrides.items())))
        if key not in built:
            name = f"spm-{'prefix' if add_dummy_prefix else 'noprefix'}-{hf_tokenizer}" + "".join(
                f"-{k}{v}" for k, v in sorted(overrides.items()))
            d = make_spm_llama(root / name, add_dummy_prefix=add_dummy_prefix, hf_tokenizer=hf_tokenizer, **overrides)
            snap = fetch(str(d), f"test/{name}")
            out = root / f"{name}.gguf"
            report = convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f16", name=snap.model_id)
            built[key] = (snap, out, report)
        return built[key]

    return build


def tokenizations(model_dir: Path, gguf_path: Path, texts: list[str]):
    """(sentencepiece, transformers, llama.cpp) ids per text, all with BOS."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    llm = Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    try:
        return [([sp.bos_id()] + sp.encode(t), list(hf(t).input_ids),
                 llm.tokenize(t.encode("utf-8"), add_bos=True, special=True)) for t in texts]
    finally:
        llm.close()


def assert_spm_metadata(out: Path, vocab_size: int, add_space_prefix: bool, sp_size: int) -> None:
    r = FastGGUFReader(str(out))
    assert field(r, "tokenizer.ggml.model") == "llama"
    assert field(r, "tokenizer.ggml.pre") == "default"
    assert bool(field(r, "tokenizer.ggml.add_space_prefix")) is add_space_prefix
    tokens, types = field(r, "tokenizer.ggml.tokens"), field(r, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == len(field(r, "tokenizer.ggml.scores")) == vocab_size
    assert (field(r, "tokenizer.ggml.unknown_token_id"), field(r, "tokenizer.ggml.bos_token_id"),
            field(r, "tokenizer.ggml.eos_token_id")) == (0, 1, 2)
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert types[:3] == [T.UNKNOWN, T.CONTROL, T.CONTROL]
    byte_ids = [i for i, t in enumerate(types) if t == T.BYTE]
    assert [tokens[i] for i in byte_ids] == [f"<0x{b:02X}>" for b in range(256)]
    assert all(t == T.NORMAL for t in types[byte_ids[-1] + 1:sp_size])
    assert all(t == T.UNUSED for t in types[sp_size:])  # config vocab beyond the SentencePiece model: padding


# --- SentencePiece ---------------------------------------------------------------------------------

def assert_full_token_parity(snap, out) -> None:
    for text, (sp_ids, hf_ids, cpp_ids) in zip(PLAIN_TEXTS, tokenizations(snap.dir, out, PLAIN_TEXTS)):
        assert hf_ids == sp_ids, text  # the HF files are a faithful copy of the SentencePiece model
        assert cpp_ids == sp_ids, text
    for text, (_, hf_ids, cpp_ids) in zip(SPECIAL_TEXTS, tokenizations(snap.dir, out, SPECIAL_TEXTS)):
        assert cpp_ids == hf_ids, text
        assert hf_ids.count(1) >= 2 or 2 in hf_ids, text  # really parsed as control tokens


@pytest.mark.parametrize("dummy_prefix,layout", [
    (True, "legacy"),  # the SentencePiece default, with the tokenizer.json layout Llama-2 repos ship
    (False, "llama"),  # add_dummy_prefix=false must reach llama.cpp as add_space_prefix=false
])
def test_spm_full_parity(spm_model, dummy_prefix, layout):
    snap, out, report = spm_model(dummy_prefix, layout)
    assert report.vocab == {"tokenizer": "sentencepiece", "size": 700, "add_space_prefix": dummy_prefix}
    assert_spm_metadata(out, 700, dummy_prefix, 700)
    assert_full_token_parity(snap, out)
    metrics, details = validate_gguf(snap, out)
    print(f"spm {layout} dummy_prefix={dummy_prefix}: {metrics}")
    assert details["tokenizer_mismatches"] == []
    assert metrics["token_parity"] == 1.0
    assert metrics["top1_agreement"] >= 0.98 and metrics["mean_kl"] < 1e-4 and metrics["finite"] is True


def test_spm_transformers5_llama_tokenizer_metaspace_differences(spm_model):
    """transformers 5 LlamaTokenizer differs from SentencePiece exactly where Metaspace skips the dummy prefix."""
    snap, out, _ = spm_model(True, "llama")
    sp = spm.SentencePieceProcessor(model_file=str(snap.dir / "tokenizer.model"))
    leading = 0
    for text, (sp_ids, hf_ids, cpp_ids) in zip(PLAIN_TEXTS, tokenizations(snap.dir, out, PLAIN_TEXTS)):
        assert cpp_ids == sp_ids, text  # llama.cpp always follows the original tokenizer
        if text.startswith(" "):
            leading += 1
            assert hf_ids != sp_ids, text
            if text.strip():  # transformers("  x") == sentencepiece(" x"): one dummy prefix fewer
                assert hf_ids == [sp.bos_id()] + sp.encode(text[1:]), text
        else:
            assert hf_ids == cpp_ids, text
    assert leading >= 3
    # after a special token written in the text: llama.cpp == the Llama-2 tokenizer.json layout, with the
    # same SentencePiece model (training is deterministic); transformers 5 LlamaTokenizer adds no prefix there
    legacy_snap, legacy_out, _ = spm_model(True, "legacy")
    assert (legacy_snap.dir / "tokenizer.model").read_bytes() == (snap.dir / "tokenizer.model").read_bytes()
    legacy = tokenizations(legacy_snap.dir, legacy_out, SPECIAL_TEXTS)
    for text, (_, hf_ids, cpp_ids), (_, legacy_hf_ids, _) in zip(
            SPECIAL_TEXTS, tokenizations(snap.dir, out, SPECIAL_TEXTS), legacy):
        assert cpp_ids == legacy_hf_ids, text
        assert hf_ids != cpp_ids, text
        spaces = [sum(sp.id_to_piece(i).count("\u2581") for i in ids) for ids in (hf_ids, cpp_ids)]
        assert spaces[0] < spaces[1], text  # the dummy prefixes transformers 5 leaves out
    # validation therefore takes the model's own SentencePiece tokenizer as the id reference
    metrics, details = validate_gguf(snap, out)
    print(f"spm transformers-5 LlamaTokenizer: {metrics}")
    assert any(t.startswith(" ") for t in prompts.TOKENIZER_TEXTS)  # the texts that differ are in the set
    assert details["tokenizer_reference"] == "sentencepiece"
    assert details["tokenizer_mismatches"] == [] and metrics["token_parity"] == 1.0
    assert metrics["top1_agreement"] >= 0.98 and metrics["mean_kl"] < 1e-4


def test_spm_vocab_padded_to_config_vocab_size(spm_model):
    """Embedding rows beyond the SentencePiece model (padded vocab) become UNUSED tokens; parity holds."""
    snap, out, report = spm_model(True, "legacy", vocab_size=768)
    assert report.vocab["size"] == 768
    assert_spm_metadata(out, 768, True, 700)
    metrics, details = validate_gguf(snap, out)
    assert details["tokenizer_mismatches"] == [] and metrics["token_parity"] == 1.0
    assert metrics["top1_agreement"] >= 0.98 and metrics["mean_kl"] < 1e-4


def test_spm_vocab_larger_than_config_is_refused(spm_model, tmp_path):
    snap, _, _ = spm_model(True, "legacy")
    with pytest.raises(ModelFormatError, match="tokenizer.model has 700 pieces but config vocab_size is 600"):
        build_vocab(snap.dir, 600, {})


def test_garbage_tokenizer_model_is_refused(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "bad-spm")
    (d / "tokenizer.model").write_bytes(b"\x00not a sentencepiece model\xff" * 10)
    with pytest.raises(ModelFormatError, match="tokenizer.model is not a SentencePiece model"):
        build_vocab(d, 49152, {})


# --- BPE -------------------------------------------------------------------------------------------

def test_bpe_smollm2_detects_smollm_pre_tokenizer(smollm2_dir):
    vocab = build_vocab(smollm2_dir, 49152, {})
    assert vocab.model == "gpt2" and vocab.pre == "smollm" and vocab.merges is True
    assert vocab.info["pre_detection"].startswith("hash:")
    assert len(vocab.tokens) == 49152 and vocab.scores is None
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text(encoding="utf-8"))
    for added in spec["added_tokens"]:  # <|endoftext|>, <|im_start|>, ... are control tokens
        assert vocab.tokens[added["id"]] == added["content"]
        assert vocab.types[added["id"]] == T.CONTROL
    assert vocab.types.count(T.NORMAL) == 49152 - len(spec["added_tokens"])


def test_bpe_token_ids_match_llama_cpp(tiny_llama, tmp_path):
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    snap = fetch(str(tiny_llama), "test/tiny-llama")
    out = tmp_path / "bpe.gguf"
    convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f16", name=snap.model_id)
    assert field(FastGGUFReader(str(out)), "tokenizer.ggml.pre") == "smollm"
    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    llm = Llama(model_path=str(out), vocab_only=True, verbose=False)
    try:
        for text in PLAIN_TEXTS + SPECIAL_TEXTS + ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"]:
            assert llm.tokenize(text.encode("utf-8"), add_bos=True, special=True) == list(hf(text).input_ids), text
    finally:
        llm.close()


def _with_tokenizer_json(src: Path, dest: Path, content: bytes | str) -> Path:
    d = copy_model(src, dest)
    (d / "tokenizer.json").write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return d


@pytest.mark.parametrize("content, message", [
    ("{\"model\": {\"type\": \"BPE\"", r"tokenizer\.json is malformed \(JSONDecodeError"),
    ("[1, 2, 3]", r"tokenizer\.json is malformed \(TypeError"),
    ("{\"model\": {\"vocab\": {}}}", r"tokenizer\.json is malformed \(KeyError"),
    (b"\xff\xfe{\x00}", r"tokenizer\.json is malformed \(UnicodeDecodeError"),
    ("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", r"model type 'WordPiece' is not supported for GGUF"),
    ("{\"model\": {\"type\": \"BPE\", \"vocab\": 5, \"merges\": [\"a b\"]}}", r"tokenizer cannot be loaded"),
])
def test_malformed_tokenizer_json_is_refused(tiny_llama, tmp_path, content, message):
    d = _with_tokenizer_json(tiny_llama, tmp_path / "bad", content)
    with pytest.raises(ModelFormatError, match=message):
        build_vocab(d, 49152, {})


def test_malformed_tokenizer_stops_conversion_before_writing(tiny_llama, tmp_path):
    d = _with_tokenizer_json(tiny_llama, tmp_path / "bad", "{not json")
    snap = fetch(str(d), "test/bad")
    out = tmp_path / "bad.gguf"
    with pytest.raises(ModelFormatError, match="tokenizer.json is malformed"):
        convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f16", name=snap.model_id)
    assert not out.exists()


def test_missing_tokenizer_is_refused(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "no-tok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match="no tokenizer.json or tokenizer.model"):
        build_vocab(d, 49152, {})


@pytest.mark.parametrize("how", ["absent", "empty"])
@pytest.mark.parametrize("options", [{}, {"bpe_pre_fallback": "gpt-2"}], ids=["no-fallback", "fallback"])
def test_bpe_without_merges_is_a_clear_error(tiny_llama, tmp_path, how, options):
    spec = json.loads((tiny_llama / "tokenizer.json").read_text(encoding="utf-8"))
    if how == "absent":
        del spec["model"]["merges"]
    else:
        spec["model"]["merges"] = []
    d = _with_tokenizer_json(tiny_llama, tmp_path / "no-merges", json.dumps(spec, ensure_ascii=False))
    with pytest.raises(ModelFormatError, match="BPE tokenizer.json has no merges: llama.cpp cannot load"):
        build_vocab(d, 49152, options)


def test_bpe_tokenizer_ids_beyond_vocab_size_are_refused(smollm2_dir):
    with pytest.raises(ModelFormatError, match="tokenizer has ids up to 49151 but config vocab_size is 49000"):
        build_vocab(smollm2_dir, 49000, {})


def test_plain_tokenizer_fast_path_equals_transformers(smollm2_dir, tmp_path):
    """Conversion reads a plain tokenizer.json with `tokenizers` (no transformers/torch import); the
    vocabulary, types, pre-tokenizer hash and BOS behaviour must equal what AutoTokenizer gives."""
    import json
    import shutil

    from pipelines.targets.gguf.vocab import _bpe_vocab, _load_hf_tokenizer, _PlainTokenizer

    fast = _bpe_vocab(smollm2_dir, 49152, None, prefer_plain=True)
    slow = _bpe_vocab(smollm2_dir, 49152, None, prefer_plain=False)
    assert isinstance(_load_hf_tokenizer(smollm2_dir), _PlainTokenizer)
    assert (fast.tokens, fast.types, fast.pre, fast.info) == (slow.tokens, slow.types, slow.pre, slow.info)
    # a class-specific switch in tokenizer_config.json sends it through transformers
    d = tmp_path / "switch"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, d / name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    assert not isinstance(_load_hf_tokenizer(d), _PlainTokenizer)


# --- byte-fallback BPE without tokenizer.model (Phi-3 style) -------------------------------------------

@pytest.fixture(scope="module")
def byte_fallback_model(tmp_path_factory):
    """The SentencePiece-trained Llamas above, shipped as tokenizer.json only (tokenizer.model removed)."""
    built = {}
    root = tmp_path_factory.mktemp("byte-fallback")

    def build(add_dummy_prefix: bool) -> Path:
        if add_dummy_prefix not in built:
            d = make_spm_llama(root / f"bf-{add_dummy_prefix}", add_dummy_prefix=add_dummy_prefix, hf_tokenizer="legacy")
            (d / "tokenizer.model").unlink()
            built[add_dummy_prefix] = d
        return built[add_dummy_prefix]

    return build


@pytest.mark.parametrize("add_dummy_prefix", [True, False], ids=["prefix", "noprefix"])
def test_byte_fallback_bpe_without_tokenizer_model(byte_fallback_model, tmp_path, add_dummy_prefix):
    snap = fetch(str(byte_fallback_model(add_dummy_prefix)), "test/byte-fallback")
    out = tmp_path / "bf.gguf"
    report = convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f16", name=snap.model_id)
    assert report.vocab["tokenizer"] == "bpe-byte-fallback"
    r = FastGGUFReader(str(out))
    assert field(r, "tokenizer.ggml.model") == "llama"
    assert field(r, "tokenizer.ggml.add_space_prefix") is add_dummy_prefix
    types = field(r, "tokenizer.ggml.token_type")
    tokens = field(r, "tokenizer.ggml.tokens")
    assert types[tokens.index("<0x0A>")] == gguf.TokenType.BYTE and types[1] == gguf.TokenType.CONTROL
    metrics, details = validate_gguf(snap, out)
    assert details["tokenizer_reference"] == "hf"  # no tokenizer.model: the HF tokenizer is the truth
    assert metrics["token_parity"] == 1.0, details["tokenizer_mismatches"]
    assert metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-4


def test_byte_fallback_bpe_needs_the_merge_scores(byte_fallback_model, tmp_path, monkeypatch):
    """Negative control: with every piece scored alike (what a placeholder score gives), llama.cpp merges in
    another order and the ids differ from the HF tokenizer's."""
    from pipelines.targets.gguf import vocab as vocab_mod

    monkeypatch.setattr(vocab_mod, "merge_scores", lambda merges: {})
    snap = fetch(str(byte_fallback_model(True)), "test/byte-fallback")
    out = tmp_path / "flat.gguf"
    convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f16", name=snap.model_id)
    metrics, _ = validate_gguf(snap, out)
    assert metrics["token_parity"] < 1.0  # measured 0.78: 2 of the 9 texts tokenize differently
