"""pipelines/validation/tokenizer_cache.py: a tokenizer's answers cached per tokenizer content.

Held here: the cached answers equal the real tokenizer's (a byte-level BPE through transformers and a
SentencePiece model); a process without transformers asks what the cache lacks in one child, and a second
process answers the same questions from the cache, neither importing transformers or torch; a tokenizer that
cannot load is the same one-line error in a child;
any change to a tokenizer file is a different key while weights are not part of it; a cache entry of the
wrong shape is ignored and replaced; keyword arguments and other attributes go to the real tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from factories import copy_model, make_spm_llama

from pipelines.validation import prompts
from pipelines.validation.reference import load_tokenizer
from pipelines.validation.tokenizer_cache import CachedTokenizer, tokenizer_key

QUESTIONS = [*prompts.PARITY_TEXTS[:3], prompts.GENERATION_PROMPT, "a", ""]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return make_spm_llama(tmp_path_factory.mktemp("tok-cache") / "spm")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HIVE_AOT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def answers(tok) -> dict:
    encoded = {t: list(tok(t).input_ids) for t in QUESTIONS}
    return {"encode": encoded, "decode": [tok.decode(ids) for ids in encoded.values()], "bos": tok.bos_token_id}


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_cached_answers_are_the_real_tokenizers(which, tiny_llama, spm_model, cache):
    model = tiny_llama if which == "bpe" else spm_model
    real = answers(load_tokenizer(model))
    first = CachedTokenizer(model)
    assert answers(first) == real and first._real is not None  # asked the real tokenizer, once per question
    second = CachedTokenizer(model)
    assert answers(second) == real
    assert second._real is None  # every answer came from the cache
    assert len(list((cache / "tokenizer-answers").glob("*.json"))) == 1


def test_prepare_asks_in_one_child_then_a_second_process_needs_none(tiny_llama, cache):
    """A process without transformers asks what the cache lacks in one child (its own memory stays light), and a
    second process answers everything from the cache: neither imports transformers or torch."""
    probe = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from pipelines.validation.tokenizer_cache import CachedTokenizer\n"
        f"tok = CachedTokenizer(Path({str(tiny_llama)!r}))\n"
        f"tok.prepare(texts={QUESTIONS!r}, decodes=[[1, 2, 3]])\n"
        f"ids = [tok(t).input_ids for t in {QUESTIONS!r}]\n"
        "print(json.dumps({'ids': ids, 'text': tok.decode([1, 2, 3]), 'bos': tok.bos_token_id,\n"
        "                  'children': tok.children,\n"
        "                  'heavy': sorted(m for m in ('transformers', 'torch') if m in sys.modules)}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    runs = [json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                                      env=env, check=True).stdout) for _ in range(2)]
    real = load_tokenizer(tiny_llama)
    assert [r["children"] for r in runs] == [1, 0] and [r["heavy"] for r in runs] == [[], []]
    for doc in runs:
        assert doc["ids"] == [list(real(t).input_ids) for t in QUESTIONS] and doc["bos"] == real.bos_token_id
        assert doc["text"] == real.decode([1, 2, 3])


def test_a_tokenizer_that_cannot_load_is_one_line_from_the_child_too(tiny_llama, tmp_path, cache):
    from pipelines.core.errors import ModelFormatError

    model = copy_model(tiny_llama, tmp_path / "broken")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ModelFormatError, match="tokenizer cannot be loaded"):
        CachedTokenizer(model).prepare(texts=["a"])  # pytest has transformers imported: asked here
    probe = ("from pathlib import Path\nfrom pipelines.validation.tokenizer_cache import CachedTokenizer\n"
             f"CachedTokenizer(Path({str(model)!r})).prepare(texts=['a'])\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert out.returncode != 0 and "ModelFormatError: tokenizer cannot be loaded" in out.stderr, out.stderr[-2000:]


def test_the_key_follows_tokenizer_files_not_weights(tiny_llama, tmp_path):
    model = copy_model(tiny_llama, tmp_path / "m")
    key = tokenizer_key(model)
    weights = model / "model.safetensors"
    weights.unlink()  # a copy may hold a link: replace, never write through it
    weights.write_bytes(b"\0" * 64)
    assert tokenizer_key(model) == key
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.unlink()
    cfg_path.write_text(json.dumps({**cfg, "model_max_length": 77}))
    changed = tokenizer_key(model)
    assert changed != key
    (model / "added_tokens.json").write_text("{}")  # a new file, too
    assert tokenizer_key(model) not in (key, changed)


@pytest.mark.parametrize("bad", [
    "not json", json.dumps([1, 2]), json.dumps({"encode": {"a": ["1"]}}), json.dumps({"encode": {"a": [1.5]}}),
    json.dumps({"decode": {"[1]": 3}}), json.dumps({"bos_token_id": "1"}),
])
def test_a_malformed_cache_entry_is_ignored_and_replaced(bad, tiny_llama, cache):
    real = load_tokenizer(tiny_llama)
    entry = cache / "tokenizer-answers" / f"{tokenizer_key(tiny_llama)}.json"
    entry.parent.mkdir(parents=True)
    entry.write_text(bad)
    tok = CachedTokenizer(tiny_llama)
    assert tok("a").input_ids == list(real("a").input_ids) and tok._real is not None
    assert json.loads(entry.read_text())["encode"] == {"a": list(real("a").input_ids)}


def test_keyword_arguments_and_other_attributes_go_to_the_real_tokenizer(tiny_llama, cache):
    real = load_tokenizer(tiny_llama)
    tok = CachedTokenizer(tiny_llama)
    ids = list(real("Hello world").input_ids)
    assert tok.decode(ids, skip_special_tokens=True) == real.decode(ids, skip_special_tokens=True)
    assert list(tok("Hello", add_special_tokens=False).input_ids) == list(real("Hello", add_special_tokens=False).input_ids)
    assert tok.get_vocab() == real.get_vocab()
    assert not list((cache / "tokenizer-answers").glob("*.json"))  # nothing of that was cached
