"""Acceptance on the real SmolLM2-135M-Instruct: the three GGUF recipes against transformers fp32,
then a CLI build + pull round trip and a greedy generation from the pulled file.

Reference points (llama.cpp's own conversion of this model on held-out text): f16 0.997 top-1;
q8_0 0.95 top-1 / KL 0.005; q4_k_m 0.89 top-1 / KL 0.07 (this model, re-quantized from Q4_1, is
sensitive). bench/compare_llamacpp.py measures both converters on our prompt set side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipelines.engine.build import build_and_publish

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def published(smollm2_dir, config, tmp_path_factory):
    store = tmp_path_factory.mktemp("smollm2-store")
    results = {r: build_and_publish(str(smollm2_dir), r, config, str(store), MODEL)
               for r in ("gguf-f16", "gguf-q8_0", "gguf-q4_k_m")}
    return store, results


def test_f16_matches_transformers(published):
    m = published[1]["gguf-f16"].validation["metrics"]
    assert published[1]["gguf-f16"].state == "published"
    assert m["top1_agreement"] >= 0.99 and m["mean_kl"] < 1e-4 and m["token_parity"] == 1.0
    assert m["positions"] >= 400


def test_q8_0_reaches_llama_cpp_reference(published):
    m = published[1]["gguf-q8_0"].validation["metrics"]
    assert m["top1_agreement"] >= 0.95 and m["mean_kl"] <= 0.005, m


def test_q4_k_m_reaches_llama_cpp_reference(published):
    m = published[1]["gguf-q4_k_m"].validation["metrics"]
    assert m["top1_agreement"] >= 0.86 and m["mean_kl"] <= 0.07, m
    assert published[1]["gguf-q4_k_m"].validation["generation"]["artifact"].startswith(" Paris")


def test_cli_build_skips_and_pull_generates(published, smollm2_dir, tmp_path):
    store, results = published
    cli = [sys.executable, "-m", "pipelines.cli"]
    proc = subprocess.run(cli + ["build", str(smollm2_dir), "--model-id", MODEL, "--recipe", "gguf-q4_k_m",
                                 "--store", str(store), "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["skipped"] is True and doc["build_id"] == results["gguf-q4_k_m"].build_id
    dest = tmp_path / "serve"
    proc = subprocess.run(cli + ["pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(dest), "--store", str(store),
                                 "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pulled = json.loads(proc.stdout)
    assert pulled["recipe"] == "gguf-q4_k_m"  # registry preference for llm-llamacpp-cpu
    marker = json.loads((dest / "hive-aot.json").read_text())
    assert marker["build_id"] == results["gguf-q4_k_m"].build_id
    from llama_cpp import Llama

    llm = Llama(model_path=pulled["files"][0], n_ctx=128, verbose=False)
    text = llm.create_completion("The capital of France is", max_tokens=4, temperature=0.0)["choices"][0]["text"]
    llm.close()
    assert text.startswith(" Paris"), text
