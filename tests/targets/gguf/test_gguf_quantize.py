"""libllama's quantizer in a child process: one summary line for the expected k-quant fallbacks, and
the counts per (requested, fallback) type recorded in the manifest's build info."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import child_helpers
import pytest
from gguf_reader import FastGGUFReader

from pipelines.core.errors import HiveError
from pipelines.source.fetch import fetch
from pipelines.targets.gguf.convert import convert
from pipelines.targets.gguf.quantize import quantize
from pipelines.targets.gguf.validate import run_llama_cpp


@pytest.fixture(scope="module")
def f32_gguf(tiny_llama, tmp_path_factory) -> Path:
    snap = fetch(str(tiny_llama), "test/tiny-llama")
    out = tmp_path_factory.mktemp("quant") / "f32.gguf"
    convert(snap.dir, snap.config(), snap.safetensors_files(), out, "f32", name=snap.model_id)
    return out


def test_k_quant_fallbacks_are_one_line_and_counted(f32_gguf, tmp_path, capfd):
    out = tmp_path / "q4_k_m.gguf"
    summary = quantize(f32_gguf, out, "Q4_K_M")
    err = capfd.readouterr().err
    # hidden size 64: no row is a multiple of 256, so every k-quant tensor falls back
    assert "falling back" not in err
    lines = [line for line in err.splitlines() if "fell back" in line]
    assert len(lines) == 1 and lines[0].startswith("llama.cpp Q4_K_M: ")
    # the recorded counts agree with the file: Q4_K_M itself never picks q5_0, so every q5_0 tensor is a
    # fallback; other types (q8_0) may also be chosen directly, so at least that many
    types = Counter(t.tensor_type.name.lower() for t in FastGGUFReader(str(out)).tensors)
    fallbacks = summary["fallbacks"]
    assert fallbacks and all(f["from"] in ("q4_K", "q5_K", "q6_K") for f in fallbacks)
    by_target = Counter()
    for f in fallbacks:
        by_target[f["to"]] += f["tensors"]
    assert by_target["q5_0"] == types["q5_0"] > 0
    assert all(n <= types[t] for t, n in by_target.items())
    assert summary["tensors"] == len(FastGGUFReader(str(f32_gguf)).tensors)
    assert f"{sum(by_target.values())} of {summary['tensors']} tensors fell back" in lines[0]


def test_quantization_without_fallbacks_prints_nothing(f32_gguf, tmp_path, capfd):
    summary = quantize(f32_gguf, tmp_path / "q8_0.gguf", "Q8_0")  # 32-wide blocks: 64 divides evenly
    assert summary["fallbacks"] == []
    assert "fell back" not in capfd.readouterr().err


def test_unknown_and_imatrix_types_are_refused_before_any_work(f32_gguf, tmp_path):
    with pytest.raises(HiveError, match=r"IQ2_XS needs an importance matrix"):
        quantize(f32_gguf, tmp_path / "x.gguf", "iq2_xs")
    with pytest.raises(HiveError, match=r"unknown llama.cpp file type 'Q9_K'"):
        quantize(f32_gguf, tmp_path / "x.gguf", "Q9_K")
    assert not (tmp_path / "x.gguf").exists()


def test_validation_of_a_large_gguf_skips_the_repacked_copy(f32_gguf, tmp_path, capfd, monkeypatch):
    """llama.cpp copies Q4_0 weights into a repacked buffer (anonymous memory) for its fast kernels; the
    validation of a GGUF above REPACK_MAX_BYTES evaluates the mapped file instead, with the same numbers
    up to kernel rounding."""
    import numpy as np

    from pipelines.process.isolation import run_isolated
    from pipelines.targets.gguf import validate

    q4 = tmp_path / "q4_0.gguf"
    quantize(f32_gguf, q4, "Q4_0")  # 32-wide blocks: every row of the tiny model qualifies
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2] / "support"))  # child_helpers.py
    capfd.readouterr()
    for repack in (True, False):
        run_isolated(child_helpers.load_gguf_verbosely, engine="llama.cpp", step="load", path=str(q4), repack=repack)
        log = capfd.readouterr().err
        assert "model buffer size" in log
        assert ("CPU_REPACK" in log) == repack, log[-2000:]

    ids = [[1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]]
    logits = {}
    for repack in (True, False):
        out_dir = tmp_path / f"logits-{repack}"
        out_dir.mkdir()
        run_isolated(run_llama_cpp, engine="llama.cpp", step="eval",
                     gguf_path=str(q4), sequences=ids, texts=["hello"], generation_prompt=ids[0][:4],
                     generation_tokens=2, logits_dir=str(out_dir), repack=repack)
        logits[repack] = np.load(out_dir / "l0.npy")
    assert logits[True].shape == logits[False].shape
    assert (logits[True].argmax(-1) == logits[False].argmax(-1)).mean() >= 0.9
    assert np.abs(logits[True] - logits[False]).max() < 0.5
    assert validate.REPACK_MAX_BYTES == 8 << 30
