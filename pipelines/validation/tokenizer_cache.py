"""A model's tokenizer answers (the ids of a text, the text of ids, the BOS id), cached per tokenizer content.

Validation asks a tokenizer a few dozen fixed questions (the prompt sets of `prompts`) and, with a cached
reference, needs nothing else from transformers; yet loading the tokenizer imports transformers and torch,
4-5 s of CPU in every build process. The answers depend only on the tokenizer's files, the libraries that
read them and the loader's choice, so they are cached under that key; the questions the cache cannot answer
are asked of the real tokenizer, in a child process unless this one has transformers imported already. The
cache is untrusted input: an entry of the wrong shape is ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..core.errors import HiveError
from ..core.paths import cache_root

# Part of the key: bump when `reference.load_tokenizer`'s choice of tokenizer for the same files changes.
# 2: a native equivalent's repository is tokenized by transformers' own class where it names one (InternVL).
LOADER_VERSION = 2
_LIBRARIES = ("transformers", "tokenizers", "sentencepiece")
# Weights and exported graphs never change what a tokenizer answers: left out of the key (and not read).
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".onnx_data", ".data",
                  ".h5", ".msgpack", ".npy", ".npz", ".qpc")


def _library_versions() -> list[str | None]:
    from importlib import metadata

    versions: list[str | None] = []
    for name in _LIBRARIES:
        try:
            versions.append(metadata.version(name))
        except metadata.PackageNotFoundError:
            versions.append(None)
    return versions


def tokenizer_key(model_dir: Path) -> str:
    """sha256 over the directory's files that can shape a tokenizer (names and bytes), the reading libraries'
    versions and LOADER_VERSION."""
    digest = hashlib.sha256(json.dumps([LOADER_VERSION, _library_versions()]).encode())
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name.endswith(_NOT_TOKENIZER):
            continue
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _valid(doc: Any) -> bool:
    if not isinstance(doc, dict):
        return False
    encoded, decoded = doc.get("encode", {}), doc.get("decode", {})
    bos = doc.get("bos_token_id", None)
    return (isinstance(encoded, dict) and all(isinstance(k, str) and _ids(v) for k, v in encoded.items())
            and isinstance(decoded, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in decoded.items())
            and (bos is None or type(bos) is int))


class CachedTokenizer:
    """The slice of the tokenizer API validation uses (`tok(text).input_ids`, `decode(ids)`, `bos_token_id`),
    answered from the cache. `prepare` asks every question the cache cannot answer of the real tokenizer
    (`reference.load_tokenizer`, with its refusal of remote code and its one-line errors) at once: in this
    process when it has transformers imported already, else in one child process, whose transformers and
    torch go back when it ends, so a GGUF validation's process stays as light as its plan counts it. A question
    nobody prepared, anything else, and any keyword argument go to the real tokenizer, loaded in this process."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._path = cache_root() / "tokenizer-answers" / f"{tokenizer_key(model_dir)}.json"
        self._answers = self._read()
        self._real = None
        self.children = 0  # how many times the real tokenizer was asked in a child

    def _read(self) -> dict[str, Any]:
        try:
            doc = json.loads(self._path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        if not _valid(doc):
            return {"encode": {}, "decode": {}}
        return {"encode": dict(doc.get("encode", {})), "decode": dict(doc.get("decode", {})),
                **({"bos_token_id": doc["bos_token_id"]} if "bos_token_id" in doc else {})}

    @property
    def real(self):
        if self._real is None:
            from .reference import load_tokenizer

            self._real = load_tokenizer(self.model_dir)
        return self._real

    def prepare(self, texts: list[str] = (), decodes: list[list[int]] = (), *, here: bool = False) -> None:
        """Have the answers to these questions (and the BOS id) at hand: what the cache lacks is asked at once,
        in one child unless `here` or transformers is imported in this process already."""
        texts = sorted({t for t in texts if t not in self._answers["encode"]})
        keys = {_decode_key(ids) for ids in decodes} - set(self._answers["decode"])
        if not texts and not keys and "bos_token_id" in self._answers:
            return
        questions = dict(texts=texts, decodes=[json.loads(k) for k in sorted(keys)])
        if here or self._real is not None or "transformers" in sys.modules:  # no memory left to spare
            got = _answers_of(self.real, **questions)
        else:
            from ..process.isolation import run_isolated

            got = run_isolated(answer_questions, engine="transformers", needs_torch=True,
                               step=f"loading the tokenizer of {self.model_dir.name}", model_dir=str(self.model_dir),
                               **questions)
            self.children += 1
        if not _valid(got) or set(got["encode"]) != set(texts) or set(got["decode"]) != keys:
            raise HiveError(f"the tokenizer child of {self.model_dir.name} answered other questions than asked")
        self._answers["encode"].update(got["encode"])
        self._answers["decode"].update(got["decode"])
        self._answers["bos_token_id"] = got["bos_token_id"]
        self._save()

    def _save(self) -> None:
        # Merged with what another process wrote meanwhile, then renamed into place: readers see whole files.
        on_disk = self._read()
        merged = {"encode": {**on_disk["encode"], **self._answers["encode"]},
                  "decode": {**on_disk["decode"], **self._answers["decode"]}}
        if "bos_token_id" in self._answers:
            merged["bos_token_id"] = self._answers["bos_token_id"]
        tmp = None
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(merged, f)
            os.replace(tmp, self._path)
        except OSError:  # a full or read-only cache costs the next process a tokenizer child, nothing more
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def encode(self, text: str) -> list[int]:
        self.prepare(texts=[text], here=True)
        return list(self._answers["encode"][text])

    def __call__(self, text: str, **kwargs):
        if kwargs:
            return self.real(text, **kwargs)
        return SimpleNamespace(input_ids=self.encode(text))

    def decode(self, ids, **kwargs) -> str:
        if kwargs:
            return self.real.decode(ids, **kwargs)
        ids = [int(i) for i in ids]
        self.prepare(decodes=[ids], here=True)
        return self._answers["decode"][_decode_key(ids)]

    @property
    def bos_token_id(self) -> int | None:
        self.prepare(here=True)
        return self._answers["bos_token_id"]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.real, name)


def _decode_key(ids: list[int]) -> str:
    return json.dumps([int(i) for i in ids])


def answer_questions(model_dir: str, texts: list[str], decodes: list[list[int]]) -> dict[str, Any]:
    """The child's side of `CachedTokenizer.prepare`: the real tokenizer's answers."""
    from .reference import load_tokenizer

    return _answers_of(load_tokenizer(Path(model_dir)), texts, decodes)


def _answers_of(tok, texts: list[str], decodes: list[list[int]]) -> dict[str, Any]:
    bos = tok.bos_token_id
    return {"encode": {t: [int(i) for i in tok(t).input_ids] for t in texts},
            "decode": {_decode_key(ids): tok.decode(ids) for ids in decodes},
            "bos_token_id": None if bos is None else int(bos)}
