"""Tokenizer -> GGUF vocabulary: SentencePiece (`llama`) and byte-level BPE (`gpt2` + pre-tokenizer).

The BPE pre-tokenizer name is looked up the way llama.cpp recognises it: encode a fixed check text
with the HF tokenizer and hash the id list. An unknown hash is an error unless the recipe names a
fallback explicitly (`options.bpe_pre_fallback`), which is then recorded in the artifact metadata:
a wrong-but-known name would load and silently tokenize differently.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import gguf

from ...core.errors import ModelFormatError
from ...core.quiet import quiet_gguf

_SPECIAL_LOOKING = re.compile(r"^(<\|.*\|>|<[a-z_]+>|\[[A-Z_]+\]|<s>|</s>|<unk>|<pad>)$")


@dataclass
class Vocab:
    model: str  # "llama" | "gpt2"
    pre: str | None
    tokens: list[str]
    scores: list[float] | None
    types: list[int]
    merges: bool
    info: dict[str, Any] = field(default_factory=dict)  # recorded in the build (detection method, sizes)


def _pre_table() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("data/bpe_pre_tokenizers.json").read_text(encoding="utf-8")
    return json.loads(text)


def _load_hf_tokenizer(model_dir: Path, prefer_plain: bool = True):
    """The tokenizer as transformers would build it.

    When tokenizer_config.json asks for no class-specific behaviour (a plain fast tokenizer, no
    add_bos/add_eos/add_prefix_space switches), transformers only wraps tokenizer.json, so we read it
    with `tokenizers` directly: same ids, without importing transformers (and torch) into a
    conversion. Anything else goes through AutoTokenizer.
    """
    if prefer_plain:
        plain = _PlainTokenizer.load(model_dir)
        if plain is not None:
            return plain
    from ...validation.reference import load_tokenizer

    return load_tokenizer(model_dir)  # the same loader (and refusal of remote code) as the reference


_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
# Model types for which transformers 5 honours a plain tokenizer_class (checked in the tests). Others,
# e.g. qwen2 and phi3, are in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS and get their own class.
_PLAIN_MODEL_TYPES = {"llama", "mistral"}
_CLASS_SWITCHES = {"add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "auto_map"}


class _PlainTokenizer:
    """The slice of the transformers tokenizer API this module uses, over `tokenizers.Tokenizer`."""

    def __init__(self, tok, bos_token: str | None):
        self.tok = tok
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.added_tokens_decoder = tok.get_added_tokens_decoder()

    @classmethod
    def load(cls, model_dir: Path) -> _PlainTokenizer | None:
        cfg_path = model_dir / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return None  # let transformers report it
        if not isinstance(cfg, dict) or cfg.get("tokenizer_class") not in _PLAIN_CLASSES or _CLASS_SWITCHES & set(cfg):
            return None
        try:
            model_type = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, RecursionError):
            return None
        if model_type not in _PLAIN_MODEL_TYPES:
            return None
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001
            raise ModelFormatError(f"tokenizer cannot be loaded: {type(e).__name__}: {e}") from None
        bos = cfg.get("bos_token")
        return cls(tok, bos.get("content") if isinstance(bos, dict) else bos)

    def get_vocab(self) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        return {t.content: i for i, t in self.added_tokens_decoder.items()}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def __call__(self, text: str):
        return type("Encoding", (), {"input_ids": self.encode(text)})()


def detect_bpe_pre(tokenizer, fallback: str | None) -> tuple[str, str]:
    table = _pre_table()
    ids = tokenizer.encode(table["check_text"])
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    name = table["hashes"].get(digest)
    if name:
        return name, f"hash:{digest[:16]}"
    if fallback:
        return fallback, f"fallback:{digest[:16]}"
    raise ModelFormatError(
        f"BPE pre-tokenizer not recognised by llama.cpp (check hash {digest[:16]}...); set recipe option "
        "bpe_pre_fallback to a llama.cpp pre-tokenizer name to override explicitly"
    )


def _bpe_vocab(model_dir: Path, vocab_size: int, fallback: str | None, prefer_plain: bool = True) -> Vocab:
    tok = _load_hf_tokenizer(model_dir, prefer_plain)
    vocab: dict[str, int] = tok.get_vocab()
    if not vocab:
        raise ModelFormatError("tokenizer has an empty vocabulary")
    if max(vocab.values()) >= vocab_size:
        raise ModelFormatError(f"tokenizer has ids up to {max(vocab.values())} but config vocab_size is {vocab_size}")
    pre, how = detect_bpe_pre(tok, fallback)
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        t = reverse[i]
        if t in added:
            # llama.cpp expects added tokens pre-normalized: round-trip non-normalized ones.
            if i in decoder and not decoder[i].normalized:
                t = tok.decode(tok.encode(t, add_special_tokens=False))
            if (i in decoder and decoder[i].special) or _SPECIAL_LOOKING.match(t):
                types.append(gguf.TokenType.CONTROL)
            else:
                t = t.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(t)
    # Whether the HF tokenizer prepends BOS, written explicitly: libllama's default depends on the
    # pre-tokenizer name and would silently differ for some BPE models.
    bos = tok.bos_token_id
    add_bos = bos is not None and list(tok("a").input_ids)[:1] == [bos]
    return Vocab("gpt2", pre, tokens, None, types, merges=True,
                 info={"tokenizer": "bpe", "pre": pre, "pre_detection": how, "size": vocab_size, "add_bos": add_bos})


def _spm_vocab(model_dir: Path, vocab_size: int) -> Vocab:
    import sentencepiece as spm

    path = model_dir / "tokenizer.model"
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelFormatError(f"tokenizer.model is not a SentencePiece model ({e})") from None
    n = sp.vocab_size()
    if n > vocab_size:
        raise ModelFormatError(f"tokenizer.model has {n} pieces but config vocab_size is {vocab_size}")
    ids = list(range(n))  # each query over every id in one call: a call per id costs more than the answers
    tokens = list(sp.id_to_piece(ids))
    scores = [float(score) for score in sp.get_score(ids)]
    kind = gguf.TokenType
    types = [kind.UNKNOWN if unknown else kind.CONTROL if control else kind.UNUSED if unused else kind.BYTE if byte
             else kind.NORMAL
             for unknown, control, unused, byte in zip(sp.is_unknown(ids), sp.is_control(ids), sp.is_unused(ids),
                                                       sp.is_byte(ids))]
    added_file = model_dir / "added_tokens.json"
    added: dict[str, int] = json.loads(added_file.read_text()) if added_file.is_file() else {}
    tj = model_dir / "tokenizer.json"
    if tj.is_file():
        for a in json.loads(tj.read_text(encoding="utf-8")).get("added_tokens", []):
            added.setdefault(a["content"], a["id"])

    def append(token: str, kind: gguf.TokenType) -> None:
        tokens.append(token)
        scores.append(-1000.0)
        types.append(kind)

    for content, idx in sorted(added.items(), key=lambda kv: kv[1]):
        if idx < n:
            continue
        if idx >= vocab_size:
            raise ModelFormatError(f"added token {content!r} has id {idx} >= vocab_size {vocab_size}")
        while len(tokens) < idx:
            append(f"[PAD{len(tokens)}]", gguf.TokenType.UNUSED)
        append(content, gguf.TokenType.USER_DEFINED)
    while len(tokens) < vocab_size:
        append(f"[PAD{len(tokens)}]", gguf.TokenType.UNUSED)
    add_prefix = _spm_add_dummy_prefix(path)
    return Vocab("llama", "default", tokens, scores, types, merges=False,
                 info={"tokenizer": "sentencepiece", "size": vocab_size, "add_space_prefix": add_prefix})


def _byte_fallback_bpe_vocab(spec: dict[str, Any], vocab_size: int) -> Vocab:
    """A SentencePiece-style BPE shipped as tokenizer.json only (Phi-3 style: byte fallback, `▁` for spaces)
    -> llama.cpp's `llama` (SentencePiece) vocabulary.

    llama.cpp's SentencePiece tokenizer merges, at each step, the adjacent pair whose concatenation is the
    vocabulary piece of highest score; HF's BPE applies the lowest-ranked merge present. Scoring each piece
    -rank of the merge that first produces it makes the two agree (pieces no merge produces keep 0: they
    are only ever single characters). Token-id parity against the HF tokenizer, part of every validation,
    checks it on real text.
    """
    model = spec["model"]
    pieces: dict[str, int] = model.get("vocab") or {}
    merges = model.get("merges") or []
    if not pieces or not merges:
        raise ModelFormatError("byte-fallback BPE tokenizer.json has no vocab or no merges")
    score = merge_scores(merges)
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    top = max(list(pieces.values()) + list(added))
    if top >= vocab_size:
        raise ModelFormatError(f"tokenizer has ids up to {top} but config vocab_size is {vocab_size}")
    by_id = {i: t for t, i in pieces.items()}
    unk = model.get("unk_token")
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        if i in added:
            a = added[i]
            tokens.append(a["content"])
            scores.append(-1000.0)
            kind = gguf.TokenType.UNKNOWN if a["content"] == unk else (
                gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
            types.append(kind)
        elif i in by_id:
            t = by_id[i]
            tokens.append(t)
            scores.append(score.get(t, 0.0))
            types.append(gguf.TokenType.UNKNOWN if t == unk else gguf.TokenType.BYTE if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t)
                         else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            scores.append(-1000.0)
            types.append(gguf.TokenType.UNUSED)
    prefix = _prepends_space(spec)
    return Vocab("llama", "default", tokens, scores, types, merges=False,
                 info={"tokenizer": "bpe-byte-fallback", "size": vocab_size, "add_space_prefix": prefix,
                       "scores": "-merge rank"})


def merge_scores(merges: list) -> dict[str, float]:
    """piece -> -rank of the first merge that produces it (tokenizer.json writes merges as "a b" or [a, b])."""
    score: dict[str, float] = {}
    for rank, merge in enumerate(merges):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        score.setdefault(a + b, -float(rank))
    return score


def _prepends_space(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer adds `▁` before the text (SentencePiece's add_dummy_prefix): a Prepend("▁")
    normalizer, or a Metaspace pre-tokenizer whose prepend scheme is not "never"."""
    def walk(node: Any) -> list[dict[str, Any]]:
        if not isinstance(node, dict):
            return []
        inner = node.get("normalizers") or node.get("pretokenizers") or []
        return [node] + [n for child in inner for n in walk(child)]

    for node in walk(spec.get("normalizer")):
        if node.get("type") == "Prepend" and node.get("prepend") == "\u2581":
            return True
    for node in walk(spec.get("pre_tokenizer")):
        if node.get("type") == "Metaspace":
            return node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never") != "never"
    return False


def _proto_fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message: ints for varints, bytes for LEN fields."""
    i, n = 0, len(buf)

    def varint() -> int:
        nonlocal i
        out = shift = 0
        while True:
            b = buf[i]
            i += 1
            out |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return out

    while i < n:
        key = varint()
        field_no, wire = key >> 3, key & 7
        if wire == 0:
            yield field_no, wire, varint()
        elif wire == 2:
            size = varint()
            if i + size > n:
                raise ValueError("truncated field")
            yield field_no, wire, buf[i:i + size]
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported wire type {wire}")


def _spm_add_dummy_prefix(path: Path) -> bool:
    """ModelProto.normalizer_spec (3) .add_dummy_prefix (3), proto2 default true.

    Read from the wire format directly: sentencepiece's generated `sentencepiece_model_pb2` needs a
    protobuf runtime matching its gencode (0.2.x wants protobuf 7, dagster pins < 7), and a silent
    default of True would make llama.cpp prepend a space the model's tokenizer never adds.
    """
    value = True
    try:
        for field_no, wire, spec in _proto_fields(path.read_bytes()):
            if field_no == 3 and wire == 2:
                for f2, w2, v2 in _proto_fields(spec):
                    if f2 == 3 and w2 == 0:
                        value = bool(v2)
    except (IndexError, ValueError) as e:
        raise ModelFormatError(f"tokenizer.model is not a valid SentencePiece model proto ({e})") from None
    return value


def build_vocab(model_dir: Path, vocab_size: int, options: dict[str, Any]) -> Vocab:
    if (model_dir / "tokenizer.model").is_file():
        return _spm_vocab(model_dir, vocab_size)
    tj = model_dir / "tokenizer.json"
    if not tj.is_file():
        raise ModelFormatError("no tokenizer.json or tokenizer.model: GGUF needs the tokenizer")
    try:
        spec = json.loads(tj.read_text(encoding="utf-8"))
        model_type = spec["model"]["type"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelFormatError(f"tokenizer.json is malformed ({type(e).__name__}: {e})") from None
    if model_type != "BPE":
        raise ModelFormatError(f"tokenizer.json model type {model_type!r} is not supported for GGUF yet (BPE, SentencePiece)")
    if spec["model"].get("byte_fallback"):
        return _byte_fallback_bpe_vocab(spec, vocab_size)
    if not spec["model"].get("merges"):
        # Checked first: without merges the pre-tokenizer check hash is meaningless and llama.cpp cannot load the vocab.
        raise ModelFormatError("BPE tokenizer.json has no merges: llama.cpp cannot load a BPE vocabulary without them")
    return _bpe_vocab(model_dir, vocab_size, options.get("bpe_pre_fallback"))


def write_vocab(writer: gguf.GGUFWriter, vocab: Vocab, model_dir: Path) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if "add_space_prefix" in vocab.info:
        writer.add_add_space_prefix(vocab.info["add_space_prefix"])
    quiet_gguf()
    special = gguf.SpecialVocab(model_dir, load_merges=vocab.merges, n_vocab=len(vocab.tokens))
    if "add_bos" in vocab.info:
        special.add_special_token.setdefault("bos", vocab.info["add_bos"])
    if vocab.merges and not special.merges:
        raise ModelFormatError("BPE tokenizer has no merges: llama.cpp cannot load it")
    special.add_to_gguf(writer, quiet=True)
