"""pipelines/targets/gguf/validate.py: a GGUF in real llama.cpp against the transformers fp32 reference.

The truth is computed here without the module: token ids by the `tokenizers` library from tokenizer.json, logits
and greedy ids by transformers' own forward pass. An f32 GGUF of a tiny Llama must agree with it; the same GGUF
with one weight matrix negated in the file must get the KL and top-1 of transformers with that matrix negated
(so the numbers are llama.cpp's function against the reference's, paired prompt by prompt), and with two
vocabulary entries swapped it must report the token mismatches. Files llama.cpp cannot load fail in one line.
The conversions themselves are test_gguf_convert.py; the repacking switch is test_gguf_quantize.py.
"""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
from factories import SMOLLM2_PRE, make_llama

from pipelines.core.errors import EngineFailed
from pipelines.source.fetch import fetch
from pipelines.targets.gguf.convert import convert
from pipelines.targets.gguf.validate import validate_gguf, validation_threads
from pipelines.validation import prompts

NEGATED_GGUF, NEGATED_HF = "blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"  # the same matrix


@pytest.fixture(scope="module")
def small_llama(smollm2_small_vocab_dir, tmp_path_factory):
    """tiny_llama's shapes on SmolLM2's vocabulary cut to 2,048 tokens: its logits and GGUF vocabulary are 24 times
    smaller than the full one's, which every validation here reads and writes."""
    return make_llama(tmp_path_factory.mktemp("validate-model") / "small-llama", smollm2_small_vocab_dir)


@pytest.fixture(scope="module")
def snap(small_llama):
    return fetch(str(small_llama), "test/small-llama")


@pytest.fixture(scope="module")
def f32_gguf(snap, tmp_path_factory):
    out = tmp_path_factory.mktemp("validate") / "small-llama-f32.gguf"
    # the cut vocabulary's check hash is unknown to llama.cpp: its pre-tokenizer is named
    convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f32", name=snap.model_id,
            options={"bpe_pre_fallback": SMOLLM2_PRE})
    return out


@pytest.fixture(scope="module")
def truth(small_llama):
    """Parity ids from tokenizer.json, transformers' logits on them (as is, and with the matrix negated) and its
    greedy continuation of the generation prompt."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer.from_file(str(small_llama / "tokenizer.json"))
    ids = [tokenizer.encode(t).ids for t in prompts.PARITY_TEXTS]
    model = AutoModelForCausalLM.from_pretrained(str(small_llama), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([s])).logits[0].numpy() for s in ids]
        seq, greedy = tokenizer.encode(prompts.GENERATION_PROMPT).ids, []
        for _ in range(prompts.GENERATION_TOKENS):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            greedy.append(nxt)
            if nxt == model.config.eos_token_id:
                break
            seq.append(nxt)
        model.get_parameter(NEGATED_HF).neg_()
        negated = [model(torch.tensor([s])).logits[0].numpy() for s in ids]
    return {"tokenizer": tokenizer, "ids": ids, "logits": logits, "negated": negated, "greedy": greedy}


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def kl_and_top1(p: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, int]:
    """Per-position KL(p || q) in float64, and how many positions' argmax agree."""
    lp, lq = log_softmax64(p), log_softmax64(q)
    return (np.exp(lp) * (lp - lq)).sum(-1), int((p.argmax(-1) == q.argmax(-1)).sum())


def edit_in_place(path, edit) -> None:
    """`edit(reader)` changes the GGUF's bytes through gguf-py's writable memory map (sizes stay the same)."""
    reader = gguf.GGUFReader(str(path), "r+")
    edit(reader)
    reader.data.flush()
    del reader


def test_an_exact_gguf_agrees_with_transformers(snap, f32_gguf, truth):
    metrics, details = validate_gguf(snap, f32_gguf)
    assert metrics["positions"] == sum(len(s) for s in truth["ids"]) > 200
    assert [p["positions"] for p in details["per_prompt"]] == [len(s) for s in truth["ids"]]
    assert metrics["finite"] is True and metrics["top1_agreement"] >= 0.99 and metrics["mean_kl"] < 1e-5, metrics
    assert metrics["token_parity"] == 1.0 and details["tokenizer_mismatches"] == []
    assert details["tokenizer_reference"] == "hf"  # no tokenizer.model: tokenizer.json is the truth
    # the greedy continuation is transformers' argmax loop, and llama.cpp's matches it token for token
    assert details["generation"]["reference"] == truth["tokenizer"].decode(truth["greedy"], skip_special_tokens=False)
    assert metrics["greedy_prefix_match"] == len(truth["greedy"])
    assert details["generation"]["artifact"] == details["generation"]["reference"]
    import llama_cpp

    assert details["engines"] == {"llama_cpp_python": llama_cpp.__version__}


def test_a_tampered_gguf_scores_what_the_tampered_model_computes(snap, f32_gguf, truth, tmp_path):
    """One matrix negated in the file: the metrics are those of transformers with that matrix negated, prompt
    by prompt (the pairing of reference and llama.cpp logits). Two tokens of the first tokenizer text swap their
    strings: llama.cpp then gives that text other ids, and validation names it with both id lists."""
    text = prompts.TOKENIZER_TEXTS[0]
    hf_ids = truth["tokenizer"].encode(text).ids

    def tamper(reader):
        (tensor,) = [t for t in reader.tensors if t.name == NEGATED_GGUF]
        tensor.data[...] = -tensor.data  # layout-independent: the same as negating it in torch
        tokens = reader.fields["tokenizer.ggml.tokens"]
        piece = {i: tokens.parts[tokens.data[i]] for i in hf_ids}  # views of the strings in the file
        a, b = next((i, j) for i in hf_ids for j in hf_ids if i < j and len(piece[i]) == len(piece[j]))
        pa, pb = bytes(piece[a]), bytes(piece[b])
        piece[a][:], piece[b][:] = np.frombuffer(pb, np.uint8), np.frombuffer(pa, np.uint8)

    tampered = tmp_path / "tampered.gguf"
    shutil.copy(f32_gguf, tampered)
    edit_in_place(tampered, tamper)
    metrics, details = validate_gguf(snap, tampered)

    per_prompt = [kl_and_top1(ref, neg) for ref, neg in zip(truth["logits"], truth["negated"])]
    expected_kl = float(np.concatenate([kl for kl, _ in per_prompt]).mean())
    expected_top1 = sum(agree for _, agree in per_prompt) / metrics["positions"]
    assert expected_kl > 0.05 and expected_top1 < 0.9  # the tampering matters to the model
    assert metrics["mean_kl"] == pytest.approx(expected_kl, rel=0.01), metrics
    assert abs(metrics["top1_agreement"] - expected_top1) <= 3 / metrics["positions"], metrics
    for got, (kl, _) in zip(details["per_prompt"], per_prompt):
        assert got["mean_kl"] == pytest.approx(float(kl.mean()), rel=0.02, abs=1e-4)

    mismatched = {m["text"]: m for m in details["tokenizer_mismatches"]}
    assert text in mismatched
    assert mismatched[text]["hf"] == hf_ids[:24] and mismatched[text]["llama_cpp"] != hf_ids[:24]
    assert metrics["token_parity"] == pytest.approx(1 - len(mismatched) / len(prompts.TOKENIZER_TEXTS), abs=1e-6)


@pytest.mark.parametrize("damage", ["truncated", "not_gguf"])
def test_a_file_llama_cpp_cannot_load_is_one_line(snap, f32_gguf, tmp_path, damage):
    bad = tmp_path / f"{damage}.gguf"
    raw = f32_gguf.read_bytes()
    bad.write_bytes(raw[: len(raw) // 3] if damage == "truncated" else b"PK\x03\x04" + os.urandom(4096))
    with pytest.raises(EngineFailed, match=rf"llama.cpp cannot load {damage}.gguf: ") as err:
        validate_gguf(snap, bad)
    assert "\n" not in str(err.value)


def test_a_phi3_name_on_a_vocabulary_without_phi3_tokens_says_why(f32_gguf, snap, tmp_path):
    """libllama gives a model named like Phi-3 Phi-3's special tokens by name; SmolLM2's vocabulary lacks them,
    and libllama's own message is a bare `unordered_map::at`."""
    def rename(reader):
        name = reader.fields["general.name"]
        value = name.parts[name.data[0]]
        new = b"Phi3" + bytes(value[4:])  # same length: the file's layout stays
        value[:] = np.frombuffer(new, np.uint8)

    named = tmp_path / "named.gguf"
    shutil.copy(f32_gguf, named)
    edit_in_place(named, rename)
    with pytest.raises(EngineFailed, match=r"unordered_map::at \(general.name 'Phi3[^']*' makes llama.cpp .*"
                                           r"publish the model under a name without 'phi3'\)$") as err:
        validate_gguf(snap, named)
    assert "\n" not in str(err.value)


def test_threads_grow_with_the_file_and_never_exceed_the_cpus_allowed():
    cpus = len(os.sched_getaffinity(0))
    assert validation_threads(0) == validation_threads(10 << 20) == 1  # a tiny model: one thread, no barrier spin
    sizes = [0, 1 << 30, 4 << 30, 64 << 30, 1 << 50]
    threads = [validation_threads(s) for s in sizes]
    assert threads == sorted(threads) and max(threads) == cpus and min(threads) >= 1
