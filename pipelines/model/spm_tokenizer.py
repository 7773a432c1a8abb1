"""A SentencePiece BPE tokenizer trained here (byte fallback, Llama-2 settings), written in the layout Llama-2
repos ship: `tokenizer.model`, `tokenizer.json` (loaded as-is by `PreTrainedTokenizerFast`) and
`tokenizer_config.json`. The tokenizer of the synthetic models (synthetic.py) and of the tests' small models.

Why SentencePiece and not a byte-level BPE: the GGUF converter identifies a BPE pre-tokenizer by hashing the
ids of a check text (as llama.cpp does) and refuses an unknown one; every freshly trained BPE vocabulary is
unknown, a SentencePiece vocabulary needs no such identification.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

WORDS = (  # English-like words the training corpora (and the tests' corpora) are made of
    "the of and to in is was for on that with as by at from it this which be are or an have has not but "
    "history printing press century movable metal type ink screw books cities scholars compare copies "
    "knowledge water oxygen carbon dioxide light energy plant cells sugar cycle temperature concentration "
    "train station travels hours arrive question answer number function return value print list range "
    "quick brown fox jumps over lazy dog hello world how are you today river mountain city market music "
    "computer program memory model weights layer token language people school garden morning evening"
).split()
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwyz" for v in "aeiou"] + ["th", "sh", "ch", "qu", "str", "pl", "gr", "ng"]


def _corpus(vocab: int, seed: int) -> list[str]:
    """English-like lines plus enough made-up words for a BPE of `vocab` pieces to find merges."""
    rng = random.Random(seed)
    invented = sorted({"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 5)))
                       for _ in range(max(2000, int(vocab * 2.4)))})
    words = WORDS * 20 + invented
    lines = []
    for _ in range(max(4000, int(vocab * 1.6))):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(3, 16)))
        r = rng.random()
        if r < 0.5:
            s = s[0].upper() + s[1:] + rng.choice(".!?;:,")
        if r < 0.15:
            s += f" {rng.randint(0, 10 ** rng.randint(1, 8))}"
        elif r < 0.25:
            s = f"{rng.choice(words)} = {rng.choice(words)}({rng.randint(0, 99)}, '{rng.choice(words)}')"
        lines.append(s)
    return lines


def spm_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary (transformers' generate_merges, without importing it)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def train_spm(corpus: list[str], vocab_size: int, *, add_dummy_prefix: bool = True) -> bytes:
    """A SentencePiece BPE model (byte fallback; Llama-2 settings: identity normalization, whitespace kept)
    trained on `corpus`, as its serialized proto."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
    )
    return buf.getvalue()


def spm_vocab(proto: bytes) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(piece -> id, BPE merges) of a serialized SentencePiece model."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    return vocab, spm_merges(vocab, {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.vocab_size())})


def write_spm_tokenizer(dest: Path, proto: bytes, *, add_dummy_prefix: bool = True) -> int:
    """tokenizer.model, tokenizer.json in the layout Llama-2 repos ship (Prepend + Replace normalizer, no
    pre-tokenizer, loaded as-is by `PreTrainedTokenizerFast`) and tokenizer_config.json. Returns the
    number of pieces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    (dest / "tokenizer.model").write_bytes(proto)
    vocab, merges = spm_vocab(proto)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("\u2581")] if add_dummy_prefix else []
    t.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    t.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if add_dummy_prefix else []))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    t.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in ("<unk>", "<s>", "</s>")])
    t.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }, indent=2) + "\n")
    return len(vocab)


def write_tokenizer(dest: Path, vocab_size: int, seed: int = 0) -> int:
    """A SentencePiece BPE with byte fallback trained here to exactly `vocab_size` pieces, written as
    `write_spm_tokenizer` does. Returns the number of pieces."""
    if vocab_size < 400:
        raise ValueError(f"a byte-fallback tokenizer needs at least 400 pieces, not {vocab_size}")
    return write_spm_tokenizer(dest, train_spm(_corpus(vocab_size, seed), vocab_size))
