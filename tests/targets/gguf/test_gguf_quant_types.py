"""Every GGUF quantization type on a model whose rows are whole 256-superblocks, and the importance matrix.

The model is a 2-layer Llama with hidden 256 and FFN 512: with hidden 64 every k-quant would fall back to
a legacy type and prove nothing. Each file's tensor types are read back with GGUFReader (the type asked
for, not a fallback) and each is loaded and run in llama.cpp against the transformers reference.

Its tokenizer is SmolLM2's BPE cut to its first 2,048 tokens (`smollm2_small_vocab_dir`; 2048 rows are whole
256-superblocks too): on the full 49,152 the embedding and output matrices were 95% of the weights and of
every conversion, quantization and llama.cpp run. llama.cpp does not know the cut vocabulary's check hash, so
every conversion here (and the recipe) names SmolLM2's pre-tokenizer (`bpe_pre_fallback`), as the GGUF family
tests do; token-id parity with llama.cpp shows the name is right. The split sizes are scaled to the smaller
files (f16 about 4.3 MiB): 1 MiB shards for the f16, 256 KiB for the streamed Q4_K_M.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import gguf
import numpy as np
import pytest
from factories import SMOLLM2_PRE, make_llama
from gguf_reader import FastGGUFReader

from pipelines.core.errors import HiveError
from pipelines.source.fetch import fetch
from pipelines.targets.gguf import GgufTarget, imatrix
from pipelines.targets.gguf.convert import convert
from pipelines.targets.gguf.quantize import quantize
from pipelines.targets.gguf.validate import validate_gguf

Q = gguf.GGMLQuantizationType
# the cut vocabulary's check hash is unknown to llama.cpp: every conversion names SmolLM2's pre-tokenizer
PRE = {"bpe_pre_fallback": SMOLLM2_PRE}


@pytest.fixture(scope="module")
def wide(smollm2_small_vocab_dir, tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("quant-types") / "llama-256", smollm2_small_vocab_dir, hidden_size=256,
                   intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, tie=False,
                   initializer_range=0.05)
    return fetch(str(d), "test/llama-256")


@pytest.fixture(scope="module")
def f16_source(wide, tmp_path_factory):
    out = tmp_path_factory.mktemp("f16") / "llama-256-f16.gguf"
    convert(wide.dir, wide.config(), wide.safetensors_files(), out, "f16", name=wide.model_id, options=PRE)
    return out


@pytest.fixture(scope="module")
def imatrix_file(wide, tmp_path_factory):
    out = tmp_path_factory.mktemp("imatrix") / "llama-256.imatrix.gguf"
    summary = imatrix.compute(wide, out)
    return out, summary


def types(path: Path) -> dict[str, Q]:
    return {t.name: t.tensor_type for t in FastGGUFReader(str(path)).tensors}


def runs_in_llama_cpp(snap, path: Path, max_kl: float) -> dict:
    metrics, details = validate_gguf(snap, path)
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0, (metrics, details["tokenizer_mismatches"])
    assert metrics["mean_kl"] <= max_kl, metrics
    return metrics


# outtype -> (its tensor type, a KL bound far above what it measures here and far below noise)
DIRECT = {"f32": (Q.F32, 1e-6), "bf16": (Q.BF16, 1e-3), "q4_0": (Q.Q4_0, 0.05), "q4_1": (Q.Q4_1, 0.05),
          "q5_0": (Q.Q5_0, 0.02), "q5_1": (Q.Q5_1, 0.02)}


@pytest.mark.parametrize("outtype", sorted(DIRECT))
def test_direct_outtypes(wide, tmp_path, outtype):
    qtype, max_kl = DIRECT[outtype]
    out = tmp_path / f"{outtype}.gguf"
    report = convert(wide.dir, wide.config(), wide.safetensors_files(), out, outtype, name=wide.model_id, options=PRE)
    t = types(out)
    matrices = [n for n in t if n.endswith(".weight") and "norm" not in n and n != "output.weight"]
    assert matrices and {t[n] for n in matrices} == {qtype}, {n: t[n].name for n in matrices}
    # the output projection stays at q8_0 under the 4-5 bit types, as llama.cpp keeps it at Q6_K
    assert t["output.weight"] == (Q.Q8_0 if outtype.startswith(("q4", "q5")) else qtype)
    assert report.fallbacks == {}
    metrics = runs_in_llama_cpp(wide, out, max_kl)
    print(f"{outtype}: {metrics}")


def test_direct_legacy_type_falls_back_on_rows_that_are_not_whole_blocks(smollm2_small_vocab_dir, tmp_path):
    """hidden 48: q4_0's 32-blocks do not divide the rows, those matrices are f16 and the report says how many."""
    d = make_llama(tmp_path / "llama-48", smollm2_small_vocab_dir, hidden_size=48, intermediate_size=64,
                   num_attention_heads=3, num_key_value_heads=1)
    snap = fetch(str(d), "test/llama-48")
    report = convert(snap.dir, snap.config(), snap.safetensors_files(), tmp_path / "q4.gguf", "q4_0",
                     name=snap.model_id, options=PRE)
    t = types(tmp_path / "q4.gguf")
    assert t["blk.0.ffn_gate.weight"] == Q.F16 and t["blk.0.ffn_down.weight"] == Q.Q4_0  # rows 48 vs 64
    assert report.fallbacks == {"Q4_0->F16": sum(1 for n, q in t.items() if q == Q.F16)}


# ftype -> the type of blk.0.attn_q.weight llama.cpp's mixture gives it
KQUANTS = {"Q2_K": Q.Q2_K, "Q3_K_M": Q.Q3_K, "Q4_K_S": Q.Q4_K, "Q4_K_M": Q.Q4_K, "Q5_K_S": Q.Q5_K,
           "Q5_K_M": Q.Q5_K, "Q6_K": Q.Q6_K, "IQ4_XS": Q.IQ4_XS, "IQ4_NL": Q.IQ4_NL}


@pytest.mark.parametrize("ftype", sorted(KQUANTS))
def test_llama_cpp_ftypes(wide, f16_source, tmp_path, ftype):
    out = tmp_path / f"{ftype}.gguf"
    summary = quantize(f16_source, out, ftype)
    assert summary["fallbacks"] == [], summary  # rows of 256 and 512: no tensor falls back
    t = types(out)
    assert t["blk.0.attn_q.weight"] == KQUANTS[ftype], t["blk.0.attn_q.weight"].name
    # Straight from the safetensors (tensor_quant.py), through f16 as the intermediate was: libllama's bytes.
    direct = tmp_path / f"{ftype}-direct.gguf"
    report = convert(wide.dir, wide.config(), wide.safetensors_files(), direct, "f16", name=wide.model_id,
                     options=PRE, ftype=ftype)
    assert report.quantization == {"tensors": sum(q not in (Q.F32, Q.F16) for q in t.values()), "fallbacks": []}
    assert filecmp.cmp(out, direct, shallow=False), ftype
    runs_in_llama_cpp(wide, out, 0.5)


def test_imatrix_is_the_mean_square_of_each_matrix_input(wide, imatrix_file):
    """Checked against an independent computation: layer 0's q/k/v input is the first RMSNorm of the embeddings."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipelines.validation.reference import encode, load_tokenizer

    path, summary = imatrix_file
    assert summary["missing"] == [] and summary["tensors"] == 2 * 7 + 1  # 7 matrices per block + output
    values = imatrix.load(path)
    ids = encode(load_tokenizer(wide.dir), [imatrix.calibration_text()])[0]
    assert summary["tokens"] == len(ids) > 300
    model = AutoModelForCausalLM.from_pretrained(str(wide.dir), dtype=torch.float32).eval()
    expect = torch.zeros(256, dtype=torch.float64)
    with torch.no_grad():
        for lo in range(0, len(ids), imatrix.CHUNK_TOKENS):
            x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([ids[lo:lo + imatrix.CHUNK_TOKENS]])))
            expect += (x[0].double() ** 2).sum(0)
    expect /= len(ids)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
        np.testing.assert_allclose(values[name], expect.numpy(), rtol=1e-4)
    assert values["blk.0.ffn_down.weight"].shape == (512,)  # the FFN's inner width: the down projection's input
    # the file is llama.cpp's imatrix layout
    r = FastGGUFReader(str(path))
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.chunk_count"].contents() == -(-len(ids) // imatrix.CHUNK_TOKENS)


IQ_TYPES = {"IQ2_XXS": Q.IQ2_XXS, "IQ2_XS": Q.IQ2_XS, "IQ3_XXS": Q.IQ3_XXS, "IQ1_S": Q.IQ1_S, "Q2_K_S": Q.Q2_K}


@pytest.mark.parametrize("ftype", sorted(IQ_TYPES))
def test_imatrix_only_types_build_with_our_imatrix(wide, f16_source, imatrix_file, tmp_path, ftype):
    with pytest.raises(HiveError, match="needs an importance matrix"):
        quantize(f16_source, tmp_path / "refused.gguf", ftype)
    assert not (tmp_path / "refused.gguf").exists()
    out = tmp_path / f"{ftype}.gguf"
    quantize(f16_source, out, ftype, imatrix=imatrix_file[0])
    assert types(out)["blk.0.ffn_up.weight"] == IQ_TYPES[ftype]
    metrics, _ = validate_gguf(wide, out)
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0  # 1.6-2.6 bits: loads and runs


def test_recipe_options_for_the_imatrix():
    problems = GgufTarget.option_problems
    assert problems({"ftype": "IQ2_XS"}) == ["ftype IQ2_XS needs an importance matrix: add imatrix: calibration"]
    assert problems({"ftype": "Q4_K_M", "imatrix": "calibration"}) == []
    assert problems({"outtype": "q4_0", "imatrix": "calibration"}) == ["imatrix weighs llama.cpp's quantizer: it needs an ftype"]
    assert problems({"ftype": "Q4_K_M", "imatrix": "wikitext"})[0].startswith("imatrix must be")


def test_split_outputs_load_in_llama_cpp(wide, tmp_path):
    """f16 split at 1 MiB of tensor data per shard (the whole file is about 4.3 MiB), then Q4_K_M quantized shard
    for shard: both load from their first shard in llama.cpp and give the unsplit numbers."""
    out = tmp_path / "split" / "m-F16.gguf"
    out.parent.mkdir()
    report = convert(wide.dir, wide.config(), wide.safetensors_files(), out, "f16", name=wide.model_id, options=PRE,
                     split_max_bytes=1 << 20)
    assert len(report.files) >= 3 and report.files[0] == f"m-F16-00001-of-{len(report.files):05d}.gguf"
    assert sorted(p.name for p in out.parent.iterdir()) == report.files and not out.exists()
    tensors = 0
    for i, f in enumerate(report.files):
        r = FastGGUFReader(str(out.parent / f))
        assert r.fields["split.no"].contents() == i and r.fields["split.count"].contents() == len(report.files)
        data = sum(int(t.n_bytes) for t in r.tensors)
        assert data <= 1 << 20 or len(r.tensors) == 1  # one tensor larger than the limit gets a shard of its own
        tensors += len(r.tensors)
    assert tensors == report.tensors
    whole = tmp_path / "whole.gguf"
    convert(wide.dir, wide.config(), wide.safetensors_files(), whole, "f16", name=wide.model_id, options=PRE)
    split_metrics = runs_in_llama_cpp(wide, out.parent / report.files[0], 1e-3)
    assert split_metrics == runs_in_llama_cpp(wide, whole, 1e-3)

    q = tmp_path / "q" / "m-Q4_K_M.gguf"
    q.parent.mkdir()
    summary = quantize(out.parent / report.files[0], q, "Q4_K_M", keep_split=True)
    assert summary["files"] == [f.replace("F16", "Q4_K_M") for f in report.files]
    runs_in_llama_cpp(wide, q.parent / summary["files"][0], 0.5)

    # Quantized as it streams (tensor_quant.py), split: each shard laid out in libllama's order and written at
    # its tensors' offsets holds the same tensors, byte for byte, as the unsplit file, and llama.cpp loads it.
    d = tmp_path / "direct"
    d.mkdir()
    shards = convert(wide.dir, wide.config(), wide.safetensors_files(), d / "m-Q4_K_M.gguf", "f16", name=wide.model_id,
                     options=PRE, ftype="Q4_K_M", split_max_bytes=1 << 18).files
    one = convert(wide.dir, wide.config(), wide.safetensors_files(), d / "one.gguf", "f16", name=wide.model_id,
                  options=PRE, ftype="Q4_K_M").files[0]
    assert len(shards) > 1
    whole_tensors = {t.name: bytes(t.data) for t in FastGGUFReader(str(d / one)).tensors}
    split_tensors = {t.name: bytes(t.data) for f in shards for t in FastGGUFReader(str(d / f)).tensors}
    assert split_tensors == whole_tensors
    runs_in_llama_cpp(wide, d / shards[0], 0.5)


def test_split_option():
    problems = GgufTarget.option_problems
    assert problems({"outtype": "f16", "split_max_size": "2G"}) == []
    assert "is not a size" in problems({"outtype": "f16", "split_max_size": "lots"})[0]


def test_recipe_with_imatrix_and_split_publishes_shards_and_the_imatrix(wide, tmp_path):
    """Through the build: the imatrix is computed, stored as an artifact file next to the shards, the
    quantizer keeps the intermediate's shards, and the manifest's serving command loads the first shard.
    Q4_K_M with the imatrix: an IQ2 type on random weights falls below any gate worth having (top-1 0.03
    measured), and which types the imatrix builds is tested above; this is the recipe plumbing."""
    import json

    import yaml
    from factories import LENIENT_VALIDATION, write_test_config

    from pipelines.config.registry import Config
    from pipelines.engine.build import build_and_publish

    cfg_dir = tmp_path / "cfg"
    registry = write_test_config(cfg_dir, Path.cwd())
    (cfg_dir / "recipes" / "gguf-q4_k_m-split.yaml").write_text(yaml.safe_dump({
        "id": "gguf-q4_k_m-split", "kind": "gguf", "options": {"ftype": "Q4_K_M", "imatrix": "calibration",
                                                               "split_max_size": "1M", **PRE},
        "runtime_profiles": ["llm-llamacpp-cpu"], "validation": LENIENT_VALIDATION}))
    result = build_and_publish(str(wide.dir), "gguf-q4_k_m-split", Config.load(registry), str(tmp_path / "store"),
                               "test-org/llama-256")
    assert result.state == "published", (result.reason, result.validation)
    names = [f["path"] for f in result.files]
    shards = [n for n in names if n.endswith(".gguf") and "-of-" in n]
    assert len(shards) >= 2 and names[0] == shards[0] and names[-1] == "llama-256-Q4_K_M.imatrix.gguf"
    manifest = json.loads((tmp_path / "store" / result.manifest.split("/store/", 1)[1]).read_text())
    assert manifest["build"]["imatrix"]["missing"] == []
    serving = next(iter(manifest["serving"].values()))
    assert serving["command"][2].endswith(shards[0])
    # the memory plan made before the build counted the shards: whole tensors packed in order make at most one
    # more than the intermediate's size over the limit
    import re

    convert_step = next(s for s in result.memory_plan["steps"] if s["step"] == "convert")
    planned = re.search(r"about (\d+) shard\(s\) of at most 1.0 MiB", convert_step["detail"])
    assert planned and int(planned.group(1)) in (len(shards) - 1, len(shards)), (convert_step["detail"], shards)
