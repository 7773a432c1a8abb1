"""Header-only remote check through the real huggingface_hub client and the olah mirror: config.json,
the shard index and each safetensors header by HTTP range; exact parameter counts, bytes fetched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from factories import copy_model, make_sharded_llama

CLI = [sys.executable, "-m", "pipelines.cli"]


def _check(repo: str, *extra: str):
    proc = subprocess.run(CLI + ["check", f"hf://{repo}@main", "--json", *extra], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.fixture(scope="module")
def sharded(hf_mirror, tmp_path_factory):
    src, params = make_sharded_llama(tmp_path_factory.mktemp("sharded") / "repo", layers=6, shards=3)
    (src / "tokenizer.json").write_text("{}")
    commit = hf_mirror.publish("remote-test/sharded", src)
    return src, params, commit


def test_sharded_repo_header_only(sharded):
    src, params, commit = sharded
    rc, doc, err = _check("remote-test/sharded")
    assert rc == 0, err
    assert doc["status"] == "compatible" and doc["runtime_profile_id"] == "vllm-cu121" and doc["commit"] == commit
    weights = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert doc["repo_weights_bytes"] == weights
    assert doc["estimated_requirements"]["parameters"] == params
    assert doc["estimated_requirements"]["weights_bytes"] == 2 * params
    # config + index + three header ranges: nothing near the weights
    assert doc["bytes_fetched"] < 3 * 64 * 1024 + 20_000 and doc["bytes_fetched"] * 50 < weights
    assert doc["estimated_requirements"]["recommended_config"]["tensor_parallel_size"] == 1


def test_single_file_repo_and_hardware(hf_mirror, tiny_llama, tmp_path):
    hf_mirror.publish("remote-test/single", copy_model(tiny_llama, tmp_path / "single"))
    rc, doc, err = _check("remote-test/single", "--hardware", "cpu")
    assert rc == 0, err
    assert (doc["status"], doc["runtime_profile_id"]) == ("compatible", "llm-llamacpp-cpu")
    from safetensors import safe_open

    with safe_open(str(tiny_llama / "model.safetensors"), framework="np") as f:
        numel = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape()[1] if len(f.get_slice(k).get_shape()) > 1 else 1)
                    for k in f.keys())
    assert doc["estimated_requirements"]["parameters"] == numel
    assert doc["bytes_fetched"] < (tiny_llama / "model.safetensors").stat().st_size / 10


def test_header_claiming_more_bytes_than_the_file_holds(hf_mirror, tmp_path):
    src, _ = make_sharded_llama(tmp_path / "bad", layers=2, shards=2)
    shard = sorted(src.glob("*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    hf_mirror.publish("remote-test/truncated", src)
    proc = subprocess.run(CLI + ["check", "hf://remote-test/truncated@main"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "truncated safetensors file" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_remote_pickle_only_is_refused(hf_mirror, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    hf_mirror.publish("remote-test/pickled", d)
    proc = subprocess.run(CLI + ["check", "hf://remote-test/pickled@main"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "never unpickles" in proc.stderr
