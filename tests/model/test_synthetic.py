"""pipelines/model/synthetic.py: sharded random Llamas with real shapes, written one chunk at a time."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipelines.model import synthetic
from pipelines.source.safetensors_io import SafetensorsFile, read_header

TINY = synthetic.preset("tiny")


def _load(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (bf16 widened exactly), through the project's reader."""
    with SafetensorsFile(path) as f:
        return {n: np.array(f.float32(n)) for n in f.header.tensors}


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_sharded_model_loads_in_transformers_with_the_stored_values(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res = synthetic.generate(tmp_path / "m", TINY, max_shard_size="1MiB", seed=3)
    d = Path(res.path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert res.shards == len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == res.weight_bytes == 2 * TINY.parameters
    headers = {s: read_header(d / s) for s in shards}  # the project's strict parser accepts every shard
    assert sum(h.parameters for h in headers.values()) == TINY.parameters == res.parameters
    for name, shape, _ in TINY.tensors():
        info = headers[index["weight_map"][name]].tensors[name]
        assert (info.dtype, info.shape) == ("BF16", shape)
    big = [s for s in shards if (d / s).stat().st_size > (1 << 20)]
    assert all(len(headers[s].tensors) == 1 for s in big)  # only a tensor larger than the limit exceeds it

    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["architectures"], cfg["model_type"], cfg["torch_dtype"]) == (["LlamaForCausalLM"], "llama", "bfloat16")
    assert (cfg["hidden_size"], cfg["num_key_value_heads"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (
        256, 2, 1024, False)
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
    state = model.state_dict()
    assert set(state) == {n for n, _, _ in TINY.tensors()}
    for name, shape, init in TINY.tensors():
        expected = synthetic.tensor_values(name, shape, init, seed=3)
        got = state[name].float().numpy()
        assert np.array_equal(got, expected), name
        if init == "ones":
            assert (got == 1.0).all()
    emb = state["model.embed_tokens.weight"].float().numpy()
    assert abs(emb.std() - 0.02) < 0.001 and abs(emb.mean()) < 0.001

    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == res.tokenizer_vocab == cfg["vocab_size"]  # trained to exactly the config's vocab
    ids = tok("The capital of France is").input_ids
    assert ids[0] == 1 and max(ids) < cfg["vocab_size"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_f32_tied_single_file(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    shape = replace(TINY, tie_word_embeddings=True)
    res = synthetic.generate(tmp_path / "m", shape, dtype="f32")
    d = Path(res.path)
    assert res.shards == 1 and not (d / "model.safetensors.index.json").exists()
    header = read_header(d / "model.safetensors")
    assert "lm_head.weight" not in header.tensors and {t.dtype for t in header.tensors.values()} == {"F32"}
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    expected = synthetic.tensor_values("model.embed_tokens.weight", (1024, 256), "normal", dtype="f32")
    assert np.array_equal(model.lm_head.weight.detach().numpy(), expected)  # tied to the embedding


def test_deterministic_for_a_seed_whatever_the_sharding(tmp_path):
    a = Path(synthetic.generate(tmp_path / "a", TINY, seed=7, max_shard_size="1MiB").path)
    b = Path(synthetic.generate(tmp_path / "b", TINY, seed=7, max_shard_size="1MiB", threads=1).path)
    assert _digests(a) == _digests(b)  # byte for byte, tokenizer included, whatever the thread count
    one = Path(synthetic.generate(tmp_path / "one", TINY, seed=7).path)  # a single shard: same values
    assert (one / "tokenizer.model").read_bytes() == (a / "tokenizer.model").read_bytes()
    merged: dict[str, np.ndarray] = {}
    for p in a.glob("model-*.safetensors"):
        merged.update(_load(p))
    single = _load(one / "model.safetensors")
    assert merged.keys() == single.keys() and all(np.array_equal(merged[k], single[k]) for k in single)
    other = Path(synthetic.generate(tmp_path / "other", TINY, seed=8).path)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(_load(other / "model.safetensors")[q], single[q])


def test_generation_streams(tmp_path):
    """Peak RSS of a child writing a ~200 MB model stays a fraction of the model (chunks, never tensors).

    The child's own VmHWM, not getrusage's ru_maxrss: Linux carries the pre-exec maximum across exec, so a
    child forked from this pytest process (hundreds of MB once transformers is loaded) would report ours."""
    shape = synthetic.LlamaShape(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                                 num_key_value_heads=2, vocab_size=4096)
    size = 2 * shape.parameters
    assert 180e6 < size < 220e6
    code = (
        "import json, resource, sys\n"
        "from pipelines.model import synthetic\n"
        f"shape = synthetic.LlamaShape(**{synthetic.asdict(shape)!r})\n"
        "res = synthetic.generate(sys.argv[1], shape, max_shard_size='64MiB')\n"
        "hwm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print(json.dumps({'maxrss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'hwm': hwm, "
        "'bytes': res.weight_bytes, 'shards': res.shards, 'seconds': res.seconds}))\n"
    )
    out = tmp_path / "streamed"
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        doc = json.loads(proc.stdout)
        assert doc["bytes"] == size and doc["shards"] >= 3
        assert sum(p.stat().st_size for p in out.glob("*.safetensors")) > size
        print(f"generated {size / 1e6:.0f} MB in {doc['seconds']:.1f} s, child peak RSS {doc['hwm'] / 1e6:.0f} MB "
              f"(getrusage: {doc['maxrss'] / 1e6:.0f} MB)")
        assert doc["hwm"] < size * 0.5, doc  # Python + numpy + the tokenizer trainer: ~60-90 MB
    finally:
        shutil.rmtree(out, ignore_errors=True)  # 200 MB: never left in pytest's kept temp dirs


def test_gguf_vocabulary_accepts_exact_and_padded_tokenizers(tmp_path):
    """The GGUF converter takes the SentencePiece vocabulary as is (no BPE pre-tokenizer hash to know), and
    pads a config vocab larger than the tokenizer with UNUSED tokens."""
    import gguf

    from pipelines.targets.gguf.vocab import build_vocab

    exact = Path(synthetic.generate(tmp_path / "exact", TINY).path)
    v = build_vocab(exact, TINY.vocab_size, {})
    assert (v.model, v.info["tokenizer"], len(v.tokens)) == ("llama", "sentencepiece", 1024)
    padded = Path(synthetic.generate(tmp_path / "padded", replace(TINY, vocab_size=1536), tokenizer_vocab=1024).path)
    v = build_vocab(padded, 1536, {})
    assert len(v.tokens) == 1536 and set(v.types[1024:]) == {gguf.TokenType.UNUSED}


def test_presets_and_refusals(tmp_path):
    assert synthetic.preset("llama3-8b").parameters == 8_030_261_248  # Meta-Llama-3-8B's exact count
    assert synthetic.preset("llama-1g").parameters == 501_007_872
    assert synthetic.preset("llama3-1b").parameters == 1_235_814_400  # Llama-3.2-1B's exact count (tied)
    with pytest.raises(ValueError, match="KV heads"):
        replace(TINY, num_key_value_heads=3)
    with pytest.raises(ValueError, match="exceeds the embedding"):
        synthetic.generate(tmp_path / "x", TINY, tokenizer_vocab=2048)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(FileExistsError):
        synthetic.generate(tmp_path / "full", TINY)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_cli(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipelines.model.synthetic", "--preset", "tiny", "--out", str(tmp_path / "m"),
                           "--seed", "1", "--max-shard-size", "1MiB"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1,705,216 parameters" in proc.stdout and "shard(s)" in proc.stdout
    again = subprocess.run([sys.executable, "-m", "pipelines.model.synthetic", "--preset", "tiny", "--out", str(tmp_path / "m")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "synthetic: error:" in again.stderr and "not an empty directory" in again.stderr
