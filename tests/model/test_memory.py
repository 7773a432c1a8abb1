"""The memory plan (pipelines/model/memory.py): estimates from headers, the budget, refusals before work, and a disk
that fills up mid-build (a real size-limited tmpfs where this host lets us mount one, else RLIMIT_FSIZE)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import uuid
from contextlib import contextmanager
from math import prod
from pathlib import Path
from types import SimpleNamespace

import pytest
from factories import copy_model, edit_config, write_test_config

from pipelines.config.kinds import target_for
from pipelines.config.registry import Config
from pipelines.core import host
from pipelines.core.errors import ConfigError, DiskFull, ResourceError
from pipelines.core.units import parse_size
from pipelines.engine.build import build_and_publish
from pipelines.model import memory
from pipelines.model.memory import (
    FP32,
    GIB,
    MIB,
    PlanEnv,
    facts_from_tensors,
    human_bytes,
    plan_build,
    reference_memory,
    reference_need,
)
from pipelines.source.fetch import FileRecord, Snapshot
from pipelines.source.safetensors_io import DTYPE_BITS, TensorInfo
from pipelines.store.local import LocalStore
from pipelines.targets.gguf import tensor_quant
from pipelines.targets.gguf.plan import gguf_bytes

REPO = Path.cwd()
MODEL = "test-org/tiny-llama"

# Llama-3-8B: hidden 4096, 32 layers, FFN 14336, GQA 32/8 (head_dim 128), vocab 128256, untied lm_head.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def llama_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,))] + ([] if cfg.get("tie_word_embeddings") else [("lm_head.weight", (v, h))])
    return out


def header_of(shapes: list[tuple[str, tuple[int, ...]]], dtype: str = "BF16") -> dict[str, TensorInfo]:
    tensors, offset = {}, 0
    for name, shape in shapes:
        n = prod(shape) * DTYPE_BITS[dtype] // 8
        tensors[name] = TensorInfo(name, dtype, shape, offset, offset + n)
        offset += n
    return tensors


def sparse_model(dest: Path, cfg: dict, dtype: str = "BF16") -> Snapshot:
    """A model directory whose safetensors file has a real header and a sparse data section (no disk used),
    so the whole snapshot path (read_header, config.json) runs on real shapes."""
    dest.mkdir(parents=True, exist_ok=True)
    tensors = header_of(llama_shapes(cfg), dtype)
    header = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.start, t.end]} for t in tensors.values()}
    raw = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    raw += b" " * (-len(raw) % 8)
    path = dest / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + max(t.end for t in tensors.values()))
    (dest / "config.json").write_text(json.dumps(cfg))
    files = [FileRecord(p.name, p.stat().st_size, "0" * 64) for p in sorted(dest.iterdir())]
    return Snapshot(model_id="test-org/sparse", source=str(dest), revision="local", commit="local", local_dir=str(dest),
                    files=files)


def fake_plan(snapshot: Snapshot, recipe, parent=None) -> SimpleNamespace:
    return SimpleNamespace(snapshot=snapshot, recipe=recipe, model_id=snapshot.model_id, parent=parent,
                           target=target_for(recipe.kind))


@pytest.fixture(scope="module")
def project_config() -> Config:
    return Config.load(REPO / "registry.yaml")


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory) -> Snapshot:
    return sparse_model(tmp_path_factory.mktemp("sparse") / "llama3-8b", LLAMA3_8B)


@pytest.fixture
def plenty_of_disk(monkeypatch):
    """Disk checks see 1 TiB free wherever they look (the host's real free space is not what these test)."""
    monkeypatch.setattr(memory, "free_bytes", lambda path: 1 << 40)


# --- estimates -------------------------------------------------------------------------------------------------

def test_facts_of_llama3_8b_shapes():
    f = facts_from_tensors(header_of(llama_shapes(LLAMA3_8B)).values(), LLAMA3_8B)
    assert f.parameters == 8_030_261_248 and f.source_bytes == 2 * f.parameters and f.fp32_bytes == 4 * f.parameters
    assert f.largest_tensor == 128256 * 4096 and f.largest_tensor_name == "model.embed_tokens.weight"
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096
    assert f.largest_layer == layer and f.layers == 32
    assert f.embedding == f.lm_head == 128256 * 4096 and not f.tied
    assert (f.vocab_size, f.hidden_size, f.kv_heads, f.head_dim) == (128256, 4096, 8, 128)
    assert f.vector_parameters == 65 * 4096 and f.float_dtypes == ("BF16",)


def test_reference_of_llama3_8b_is_bounded_by_its_largest_unit_not_the_model():
    f = facts_from_tensors(header_of(llama_shapes(LLAMA3_8B)).values(), LLAMA3_8B)
    need, detail = reference_memory(f)
    unit = 128256 * 4096 * FP32  # the embedding (and the untied lm_head) is the largest unit, not a layer
    assert unit < need < 3 * unit + 2 * GIB  # a unit or two, activations and logits of one batch
    assert need < f.fp32_bytes / 5  # 40% of the 29.9 GiB fp32 model would be 12 GiB
    assert "x the embedding 1.9 GiB fp32" in detail
    wider = facts_from_tensors(header_of(llama_shapes({**LLAMA3_8B, "vocab_size": 2 * 128256})).values(),
                               {**LLAMA3_8B, "vocab_size": 2 * 128256})
    assert reference_memory(wider)[0] > need + unit  # twice the vocabulary: a unit as large again, and logits


# The sizes of the published Llama-3-8B GGUFs (llama.cpp's own conversions), bytes: what the plans are held to.
PUBLISHED_LLAMA3_8B_GGUF = {"f16": 16.07e9, "bf16": 16.07e9, "q8_0": 8.54e9, "Q4_K_M": 4.92e9, "Q6_K": 6.60e9}


def near_published(size: int, file_type: str) -> bool:
    return abs(size / PUBLISHED_LLAMA3_8B_GGUF[file_type] - 1) < 0.03


def test_gguf_sizes_of_llama3_8b_match_llama_cpp():
    """Within a few percent of the published Llama-3-8B GGUFs (f16 16.07 GB, q8_0 8.54 GB, Q4_K_M 4.92 GB)."""
    f = facts_from_tensors(header_of(llama_shapes(LLAMA3_8B)).values(), LLAMA3_8B)
    for file_type in ("f16", "q8_0", "Q4_K_M", "Q6_K"):
        assert near_published(gguf_bytes(f, file_type), file_type), file_type
    assert gguf_bytes(f, "Q9_UNKNOWN") == gguf_bytes(f, "Q8_0")  # unknown types: the largest quantized size


def _plan(snapshot, config, recipe_id, store=None):
    recipe = config.recipe(recipe_id)
    parent = fake_plan(snapshot, config.recipe(recipe.input)) if recipe.input else None
    return plan_build(fake_plan(snapshot, recipe, parent), store)


def test_plan_of_llama3_8b_from_a_sparse_snapshot(llama3_8b, project_config, plenty_of_disk, monkeypatch):
    """Every shipped recipe kind of an 8B model fits a 12 GiB budget (streamed converters and exports, the
    reference and the artifact unit by unit, engine checks on layer slices); at 4 GiB the steps that cannot fit
    are named with their need and the budget, in one line."""
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", "12G")
    f16 = _plan(llama3_8b, project_config, "gguf-f16")
    assert [s.step for s in f16.steps] == ["convert", "publish", "reference", "validate"]
    assert f16.fits() and f16.budget == 12 * GIB and f16.budget_source == "HIVE_AOT_MEMORY_BUDGET"
    # The streamed reference holds its largest unit (the 1.9 GiB fp32 embedding) and the logits; the converter
    # only row slices of it.
    assert f16.peak.step == "reference" and f16.steps[0].memory < GIB
    convert, validate = f16.steps[0], f16.steps[-1]
    assert near_published(convert.disk, "f16")
    assert validate.mapped == convert.disk  # the GGUF is mapped by llama.cpp: reported, not counted
    assert validate.memory < 3 * GIB

    q4 = _plan(llama3_8b, project_config, "gguf-q4_k_m")
    steps = {s.step: s for s in q4.steps}
    # quantized as it streams (tensor_quant.py): only the output on disk, the converter's row slices in memory
    assert list(steps) == ["convert", "publish", "reference", "validate"] and q4.fits()
    assert near_published(steps["convert"].disk, "Q4_K_M") and steps["convert"].memory < GIB
    # Where libllama lacks llama-ext.h (or with an imatrix): the bf16 intermediate, then libllama's quantizer.
    with monkeypatch.context() as m:
        m.setattr(tensor_quant, "unavailable", lambda: "this libllama lacks llama_quant_compute_types")
        steps = {s.step: s for s in _plan(llama3_8b, project_config, "gguf-q4_k_m").steps}
    assert list(steps) == ["convert", "quantize", "publish", "reference", "validate"]
    inter, out = steps["convert"].disk, steps["quantize"].disk - steps["convert"].disk
    assert near_published(inter, "bf16") and near_published(out, "Q4_K_M")  # the intermediate, then both at once
    assert steps["quantize"].mapped == inter and steps["quantize"].memory < 5 * GIB  # 2 fp32 copies of 1.96 GiB

    for rid in ("vllm-bf16", "vllm-fp8", "vllm-w8a8-int8", "vllm-w4a16", "qaic-export", "qaic-mxfp6", "qaic-fp16"):
        plan = _plan(llama3_8b, project_config, rid)
        assert plan.fits(), (rid, plan.problems())
        build_step = "prepare" if rid.startswith("vllm") else {"qaic-export": "export"}.get(rid, "bundle")
        assert next(s for s in plan.steps if s.step == build_step).memory < 2 * GIB  # streamed, whatever the size
    # GPTQ's pass: one layer (0.9 GiB fp32), its Hessians (14336-wide down_proj: 0.8 GiB each), the calibration
    calibrate = next(s for s in _plan(llama3_8b, project_config, "vllm-w4a16").steps if s.step == "calibrate")
    assert 4 * GIB < calibrate.memory < 6 * GIB and "14336^2" in calibrate.detail
    vllm = _plan(llama3_8b, project_config, "vllm-bf16")
    assert "its first 2 layers" in vllm.steps[-1].detail  # 12 GiB cannot hold vLLM's fp32 copy: a slice

    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", "4G")
    export = _plan(llama3_8b, project_config, "qaic-export")
    with pytest.raises(ResourceError) as e:
        export.check()
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 7
    assert msg.startswith("qaic-export of test-org/sparse: step 'validate' needs ") and msg.endswith(
        "budget 4.0 GiB (HIVE_AOT_MEMORY_BUDGET); nothing was built")
    assert e.value.plan["fits"] is False
    assert [p.split(" needs")[0] for p in _plan(llama3_8b, project_config, "vllm-bf16").problems()] == \
        ["step 'validate'"]  # the prepare streams; the validation's slice does not fit 4 GiB


def test_disk_need_counts_the_intermediate_and_blobs_kept_on_the_same_file_system(llama3_8b, project_config,
                                                                                  monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "free_bytes", lambda path: 10 * GIB)
    direct = plan_build(fake_plan(llama3_8b, project_config.recipe("gguf-q4_k_m")), LocalStore(tmp_path / "store"))
    assert direct.problems() == []  # quantized as it streams: 4.6 GiB of output, no intermediate
    monkeypatch.setattr(tensor_quant, "unavailable", lambda: "this libllama lacks llama_quant_compute_types")
    q4 = plan_build(fake_plan(llama3_8b, project_config.recipe("gguf-q4_k_m")), LocalStore(tmp_path / "store"))
    convert, quantize = q4.problems()  # the bf16 intermediate, then the intermediate and the Q4_K_M output at once
    assert convert.startswith("step 'convert' needs 14.9 GiB of disk in ") and convert.endswith("which has 10.0 GiB free")
    assert quantize.startswith("step 'quantize' needs 19.5 GiB of disk in ")
    assert q4.steps[2].step == "publish" and q4.steps[2].disk == 0  # hard links on the work root's file system
    needs = {s.step: need for s, need in q4.disk_needs()}
    assert near_published(needs["validate"] - q4.steps[-1].disk, "Q4_K_M")  # the published blob stays in the store


def test_reference_need_of_a_snapshot(llama3_8b):
    assert reference_need(llama3_8b) == reference_memory(facts_from_tensors(
        header_of(llama_shapes(LLAMA3_8B)).values(), LLAMA3_8B))[0]


def test_tied_embeddings_count_the_embedding_as_the_lm_head():
    cfg = {**LLAMA3_8B, "tie_word_embeddings": True}
    f = facts_from_tensors(header_of(llama_shapes(cfg)).values(), cfg)
    assert f.tied and f.lm_head == 0 and f.parameters == 8_030_261_248 - 128256 * 4096
    assert reference_memory(f)[0] == reference_memory(facts_from_tensors(
        header_of(llama_shapes(LLAMA3_8B)).values(), LLAMA3_8B))[0]


# --- absurd sizes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("hidden_size", 10**9), ("vocab_size", 10**12), ("num_hidden_layers", -3),
                                        ("num_key_value_heads", 10**400)])
def test_absurd_config_sizes_are_refused_in_one_line(key, value):
    cfg = {**LLAMA3_8B, key: value}
    with pytest.raises(ResourceError) as e:
        facts_from_tensors(header_of(llama_shapes(LLAMA3_8B)).values(), cfg, "org/absurd")
    msg = str(e.value)
    assert msg.startswith(f"org/absurd: config.json {key}=") and "not a plausible model size" in msg
    assert "\n" not in msg and len(msg) < 400


def test_petabyte_headers_are_refused_with_a_printable_need(project_config, llama3_8b, plenty_of_disk, monkeypatch):
    """Shapes whose product is petabytes (a sparse file can claim them) and beyond any float: a clear refusal."""
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", "24G")
    huge = {"model.layers.0.mlp.down_proj.weight": TensorInfo("model.layers.0.mlp.down_proj.weight", "F32",
                                                              (1 << 25, 1 << 25), 0, 1 << 52)}
    f = facts_from_tensors(huge.values(), {})
    assert f.fp32_bytes == 1 << 52 and human_bytes(f.fp32_bytes) == "4.0 PiB"
    env = PlanEnv(facts=f, options=project_config.recipe("gguf-f16").options, config={}, work="/w", store=None,
                  refs="/c", linkable=True, budget=24 * GIB)
    plan = memory.MemoryPlan("org/huge", "gguf-f16", target_for("gguf").plan_steps(env), 24 * GIB,
                             "HIVE_AOT_MEMORY_BUDGET", {"/w": 1 << 40, "/c": 1 << 40})
    with pytest.raises(ResourceError, match=r"step 'reference' needs 5\.0 PiB of memory \(its largest unit: a decoder "
                                            r"layer, 4\.0 PiB in fp32\), budget 24\.0 GiB"):
        plan.check()
    assert human_bytes(10**400).startswith("about 2^1328 B")


# --- budget ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("12G", 12 * GIB), ("12GiB", 12 * GIB), ("12gib", 12 * GIB), ("800M", 800 * MIB),
                                         ("1M", MIB), ("1.5G", 3 * GIB // 2), ("12GB", 12 * 10**9), ("4096", 4096),
                                         (" 2T ", 2 << 40), ("64k", 64 * 1024)])
def test_budget_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "12X", "-1", "0", "12Gi", "1e9", "G"])
def test_invalid_budget_is_one_config_error_line(text, monkeypatch):
    monkeypatch.setenv("HIVE_AOT_MEMORY_BUDGET", text)
    if not text.strip():
        assert host.memory_budget()[1] == "memory available on this host"  # empty: unset
        return
    with pytest.raises(ConfigError) as e:
        host.memory_budget()
    assert str(e.value).startswith(f"HIVE_AOT_MEMORY_BUDGET={text!r} is not a size") and "\n" not in str(e.value)


def test_host_budget_is_what_the_host_has(monkeypatch):
    monkeypatch.delenv("HIVE_AOT_MEMORY_BUDGET", raising=False)
    budget, source = host.memory_budget()
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(meminfo["MemTotal"].split()[0]) * 1024
    assert source == "memory available on this host" and 0 < budget <= total


def test_host_budget_is_capped_by_the_processs_own_nested_cgroup():
    """A build started inside a child memory cgroup with a limit (the bench's --cgroup-limit, a Kubernetes pod's
    container cgroup below the node's) takes that limit as its budget, not the mount root's (found by the 8B
    bench: its builds planned against 22.6 GiB inside a 12 GiB cgroup)."""
    own = next((ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                if ln.split(":", 2)[1] == "memory"), None)  # cgroup v1 here; v2 has the same rule
    parent = Path("/sys/fs/cgroup/memory") / own.lstrip("/") if own else None
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("needs a writable cgroup v1 memory hierarchy (root in a container that delegates it)")
    child = parent / f"hive-budget-{uuid.uuid4().hex[:8]}"
    child.mkdir()
    try:
        (child / "memory.limit_in_bytes").write_text(str(3 * GIB))
        env = {k: v for k, v in os.environ.items() if k != "HIVE_AOT_MEMORY_BUDGET"}
        proc = subprocess.run([sys.executable, "-c", "from pipelines.core import host; print(host.memory_budget()[0])"],
                              cwd=REPO, capture_output=True, text=True, check=True, env={**env, "PYTHONPATH": str(REPO)},
                              preexec_fn=lambda: (child / "tasks").write_text(str(os.getpid())))
        assert 2 * GIB < int(proc.stdout) <= 3 * GIB, proc.stdout
    finally:
        child.rmdir()


# --- the CLI: refusal before work, plan, skipped builds ----------------------------------------------------

def hive(*args: str, env: dict[str, str] | None = None, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                          preexec_fn=preexec)


def store_contents(store: Path) -> list[str]:
    """Everything a reader of the store could take for an artifact: blobs (temporaries too), manifests, refs,
    staging records."""
    if not store.exists():
        return []
    return sorted(str(p.relative_to(store)) for p in store.rglob("*")
                  if p.is_file() and p.relative_to(store).parts[0] in ("blobs", "manifests", "refs", "staging"))


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    return write_test_config(tmp_path_factory.mktemp("memory-cfg"), REPO)


def test_over_budget_build_is_refused_before_work_and_publishes_nothing(tiny_llama, smollm2_dir, registry, tmp_path):
    store = tmp_path / "store"
    proc = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "gguf-f16", "--store", str(store),
                "--registry", str(registry), env={"HIVE_AOT_MEMORY_BUDGET": "1M"})
    assert proc.returncode == 7, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("hive-aot: [")]  # step lines
    assert len(lines) == 1 and lines[0].startswith(f"hive-aot: error: gguf-f16 of {MODEL}: step '")
    named = re.findall(r"'(\w+)' (?:needs )?\d", lines[0])  # the largest step first, then the others over it
    assert named[0] in ("reference", "validate") and {"reference", "validate"} <= set(named), lines[0]
    assert lines[0].endswith("budget 1.0 MiB (HIVE_AOT_MEMORY_BUDGET); nothing was built")
    assert proc.stdout == "" and store_contents(store) == []
    as_json = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "gguf-f16", "--store", str(store),
                   "--registry", str(registry), "--json", env={"HIVE_AOT_MEMORY_BUDGET": "1M"})
    assert as_json.returncode == 7 and json.loads(as_json.stdout)["exit_code"] == 7
    # A derived recipe's whole chain is planned first: its input (the ONNX export) is not built either.
    chain = hive("build", str(smollm2_dir), "--model-id", "HuggingFaceTB/SmolLM2-135M-Instruct", "--recipe",
                 "qaic-mxfp6", "--store", str(store), "--registry", str(registry),
                 env={"HIVE_AOT_MEMORY_BUDGET": "1M"})
    assert chain.returncode == 7, chain.stderr
    assert "error: qaic-export of HuggingFaceTB/SmolLM2-135M-Instruct: step '" in chain.stderr
    assert store_contents(store) == []


def test_plan_command_shows_every_step_and_exits_7_when_a_build_would_be_refused(tiny_llama, registry, tmp_path):
    args = ("plan", str(tiny_llama), "--model-id", MODEL, "--recipe", "gguf-q4_k_m", "--store", str(tmp_path / "s"),
            "--registry", str(registry))
    ok = hive(*args, "--json", env={"HIVE_AOT_MEMORY_BUDGET": "8G"})
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    (plan,) = doc["plans"]
    # published: unknown (None) unless the source's digests are cached: a plan reads headers only
    assert doc["fits"] is True and plan["fits"] is True and plan["published"] in (False, None)
    assert [s["step"] for s in plan["steps"]] == ["convert", "publish", "reference", "validate"]  # no intermediate
    assert all(s["memory"] > 0 for s in plan["steps"]) and plan["model"]["vocab_size"] == 49152
    human = hive(*args, env={"HIVE_AOT_MEMORY_BUDGET": "100M"})
    assert human.returncode == 7
    assert human.stdout.startswith(f"gguf-q4_k_m of {MODEL}: does NOT fit (budget 100.0 MiB, HIVE_AOT_MEMORY_BUDGET)")
    assert "refused: step '" in human.stdout and "'reference' " in human.stdout and "'validate' " in human.stdout
    assert human.stderr.count("\n") == 1 and human.stderr.endswith("; a build would be refused\n")
    assert not (tmp_path / "s").exists()  # a plan writes nothing


def test_published_builds_are_skipped_whatever_the_budget(tiny_llama, registry, tmp_path):
    store = tmp_path / "store"
    first = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "gguf-f16", "--store", str(store),
                 "--registry", str(registry), "--json")
    assert first.returncode == 0, first.stderr
    res = json.loads(first.stdout)
    assert res["state"] == "published" and res["memory_plan"]["fits"] is True
    assert [s["step"] for s in res["memory_plan"]["steps"]] == ["convert", "publish", "reference", "validate"]
    again = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "gguf-f16", "--store", str(store),
                 "--registry", str(registry), "--json", env={"HIVE_AOT_MEMORY_BUDGET": "1M"})
    assert again.returncode == 0, again.stderr
    res2 = json.loads(again.stdout)
    assert res2["state"] == "skipped" and res2["memory_plan"]["fits"] is False  # reported, not enforced
    # one copy of the artifact: the blob was linked from the work dir, which is gone, so it has one name
    (entry,) = res["files"]
    blob = store / "blobs" / "sha256" / entry["sha256"][:2] / entry["sha256"]
    assert blob.stat().st_nlink == 1 and blob.stat().st_mode & 0o777 == 0o644


# --- the store links the build's files instead of copying them -----------------------------------------------

def test_blob_is_a_hard_link_of_the_build_file_and_survives_its_work_dir(tmp_path):
    work, store = tmp_path / "work", LocalStore(tmp_path / "store")
    work.mkdir()
    made = work / "model.gguf"
    made.write_bytes(os.urandom(1 << 20))
    os.chmod(made, 0o600)
    digest = hashlib.sha256(made.read_bytes()).hexdigest()
    store.put_blob(made, digest, handover=True)
    blob = tmp_path / "store" / "blobs" / "sha256" / digest[:2] / digest
    assert blob.stat().st_ino == made.stat().st_ino and blob.stat().st_mode & 0o777 == 0o644
    shutil.rmtree(work)
    assert blob.stat().st_nlink == 1 and hashlib.sha256(blob.read_bytes()).hexdigest() == digest
    assert store.blob_intact(digest, 1 << 20)
    assert [p.name for p in blob.parent.iterdir()] == [digest]  # no temporary left


def test_a_build_publishes_its_output_as_the_blob_itself(tiny_llama, registry, tmp_path, monkeypatch):
    """End to end: the GGUF written in the work dir becomes the store's blob by a hard link (the same inode), the
    work dir goes, and the blob is then the file's only name, intact: one copy of the artifact on disk."""
    linked = []
    real = LocalStore._link_into_place

    def spy(self, path, dest, sha256):
        inode = path.stat().st_ino
        ok = real(self, path, dest, sha256)
        linked.append((path.name, inode, ok, sha256))
        return ok

    monkeypatch.setattr(LocalStore, "_link_into_place", spy)
    store = tmp_path / "store"
    res = build_and_publish(str(tiny_llama), "gguf-f16", Config.load(registry), str(store), MODEL)
    (entry,) = res.files
    blob = store / "blobs" / "sha256" / entry["sha256"][:2] / entry["sha256"]
    # hashed once, by put_blob, so taking the file over reads it no second time (sha256 None: no re-check)
    assert [(name, ok, sha256) for name, _inode, ok, sha256 in linked] == [("tiny-llama-F16.gguf", True, None)]
    assert blob.stat().st_ino == linked[0][1] and blob.stat().st_nlink == 1
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == entry["sha256"] and blob.stat().st_mode & 0o777 == 0o644
    from pipelines.core.paths import work_root

    assert not any(d.name.startswith("build-") for d in work_root().iterdir())


def test_a_file_shared_with_a_source_is_copied_not_linked(tmp_path):
    """A work file that is a hard link to the user's source (vLLM carries bf16 shards that way) must not become
    the store's blob: editing the source would change it."""
    source = tmp_path / "source.safetensors"
    source.write_bytes(b"x" * 4096)
    work = tmp_path / "work"
    work.mkdir()
    os.link(source, work / "model.safetensors")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    LocalStore(tmp_path / "store").put_blob(work / "model.safetensors", digest, handover=True)
    blob = tmp_path / "store" / "blobs" / "sha256" / digest[:2] / digest
    assert blob.stat().st_ino != source.stat().st_ino and blob.read_bytes() == source.read_bytes()


def test_without_handover_the_store_copies(tmp_path):
    """A caller that keeps its file (put_blob without handover) gets an independent copy."""
    made = tmp_path / "kept.bin"
    made.write_bytes(b"z" * 4096)
    digest = hashlib.sha256(made.read_bytes()).hexdigest()
    LocalStore(tmp_path / "store").put_blob(made, digest)
    blob = tmp_path / "store" / "blobs" / "sha256" / digest[:2] / digest
    assert blob.stat().st_ino != made.stat().st_ino and made.stat().st_nlink == 1


def test_a_wrong_digest_is_refused_and_leaves_no_blob(tmp_path):
    made = tmp_path / "model.gguf"
    made.write_bytes(b"y" * 100)
    store = LocalStore(tmp_path / "store")
    from pipelines.core.errors import IntegrityError

    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        store.adopt_file("blobs/sha256/00/" + "0" * 64, made, "0" * 64)
    assert not any(p.is_file() for p in (tmp_path / "store").rglob("*"))


# --- disk full -----------------------------------------------------------------------------------------------

@contextmanager
def small_filesystem(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at `path` (needs root, as in this project's build containers); skips
    where mounting is not allowed (RLIMIT_FSIZE below covers disk full there)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-limited tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", f"hive-aot-test-{uuid.uuid4().hex[:8]}",
                           str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def roomy_plan(monkeypatch):
    """The plan saw plenty of free disk (another writer took it since): what a disk that fills up mid-build
    looks like. Only the plan's view changes; the error reports the real free space."""
    from pipelines.engine import build

    real = build.resource_plan

    def roomy(p, store):
        plan = real(p, store)
        plan.disk_free = {where: 1 << 40 for where in plan.disk_free}
        return plan

    def apply():
        monkeypatch.setattr(build, "resource_plan", roomy)
    return apply


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A cache root of this test's own (its work root may be a small file system)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("HIVE_AOT_CACHE", str(cache))
    return cache


def test_disk_full_while_converting_is_one_line_and_leaves_nothing(tiny_llama, registry, tmp_path, own_cache,
                                                                    roomy_plan):
    """The work root fills up while the GGUF is written."""
    roomy_plan()
    store = tmp_path / "store"
    with small_filesystem(own_cache / "work", 2 * MIB) as work:
        with pytest.raises(DiskFull) as e:
            build_and_publish(str(tiny_llama), "gguf-f16", Config.load(registry), str(store), MODEL)
        msg = str(e.value)
        assert "\n" not in msg and e.value.exit_code == 7
        assert msg.startswith(f"gguf-f16 of {MODEL}: disk full during step 'convert' (no space left on device) "
                              f"writing under {work}/build-")
        assert f"(tmpfs file system at {work}, " in msg and msg.endswith("partial files removed, nothing was published")
        assert list(work.iterdir()) == []  # the work dir and its partial GGUF are gone
    assert store_contents(store) == []


@pytest.mark.parametrize("recipe, step", [("vllm-fp8", "prepare"), ("qaic-export", "export"), ("gguf-q4_k_m", "convert")])
def test_disk_full_while_quantizing_or_exporting_is_one_line_and_leaves_nothing(recipe, step, tiny_llama, registry,
                                                                                  tmp_path, own_cache, roomy_plan):
    """The work root fills up while FP8 shards, the ONNX export's external data or a k-quant GGUF (quantized as
    it streams, written at each tensor's offset) are written."""
    roomy_plan()
    store = tmp_path / "store"
    with small_filesystem(own_cache / "work", 2 * MIB) as work:
        with pytest.raises(DiskFull) as e:
            build_and_publish(str(tiny_llama), recipe, Config.load(registry), str(store), MODEL)
        msg = str(e.value)
        assert "\n" not in msg and e.value.exit_code == 7
        assert msg.startswith(f"{recipe} of {MODEL}: disk full during step '{step}' (no space left on device)"), msg
        assert f"(tmpfs file system at {work}, " in msg and msg.endswith("partial files removed, nothing was published")
        assert list(work.iterdir()) == []  # the work dir and the partial shards / data file are gone
    assert store_contents(store) == []


def test_disk_full_in_the_store_removes_the_partial_blob(tiny_llama, registry, tmp_path, own_cache, roomy_plan):
    """The store's file system fills up while the blob is copied in: the temporary goes, no staging record."""
    store = tmp_path / "store"
    with small_filesystem(store, 2 * MIB):
        # Up front, the plan refuses: the copy into another file system needs the artifact's size there.
        with pytest.raises(ResourceError, match=r"step 'publish' needs \d+\.\d MiB of disk in .*store, which has 2\.0 MiB"):
            build_and_publish(str(tiny_llama), "gguf-f16", Config.load(registry), str(store), MODEL)
        roomy_plan()
        with pytest.raises(DiskFull) as e:
            build_and_publish(str(tiny_llama), "gguf-f16", Config.load(registry), str(store), MODEL)
        msg = str(e.value)
        assert msg.startswith(f"gguf-f16 of {MODEL}: disk full during step 'publish' (no space left on device) "
                              f"writing under {store}/blobs/sha256/")
        assert f"(tmpfs file system at {store}, " in msg
        assert store_contents(store) == [] and not any(p.is_file() for p in store.rglob("*"))
    assert not any((own_cache / "work").iterdir())


def test_disk_full_in_the_quantizer_child_is_one_line(tiny_llama, registry, tmp_path, own_cache, roomy_plan,
                                                      monkeypatch):
    """libllama's quantizer (a child process) runs out of room after the intermediate was written (the path a
    k-quant takes with an importance matrix, or where libllama lacks llama-ext.h: forced here)."""
    monkeypatch.setattr(tensor_quant, "unavailable", lambda: "forced by the test")
    store = tmp_path / "store"
    f16 = build_and_publish(str(tiny_llama), "gguf-f16", Config.load(registry), str(tmp_path / "sizes"), MODEL)
    intermediate = f16.files[0]["size"]  # the bf16 intermediate has the f16 file's layout
    roomy_plan()
    with small_filesystem(own_cache / "work", intermediate + 256 * 1024) as work:
        with pytest.raises(DiskFull) as e:
            build_and_publish(str(tiny_llama), "gguf-q4_k_m", Config.load(registry), str(store), MODEL)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"gguf-q4_k_m of {MODEL}: llama.cpp quantization to Q4_K_M: disk full during step "
                              "'quantize' (no space left on device)")
        assert "tmpfs file system at" in msg
        assert list(work.iterdir()) == []
    assert store_contents(store) == []


def test_file_size_limit_is_treated_as_disk_full(tiny_llama, registry, tmp_path):
    """Where no file system can be mounted: RLIMIT_FSIZE in the CLI's process makes writes past 2 MiB fail with
    EFBIG (SIGXFSZ ignored), which the build reports as a full disk."""
    store = tmp_path / "store"
    limit = 2 * MIB

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = hive("build", str(tiny_llama), "--model-id", MODEL, "--recipe", "gguf-f16", "--store", str(store),
                "--registry", str(registry), preexec=limited, env={"HIVE_AOT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 7, proc.stderr
    *steps, line = proc.stderr.strip().splitlines()
    assert steps[-1].startswith("hive-aot: [gguf-f16: convert] failed after "), proc.stderr  # progress.py's step lines
    assert line.startswith(f"hive-aot: error: gguf-f16 of {MODEL}: disk full during step 'convert' (file size limit "
                           "exceeded (EFBIG")
    assert line.endswith("partial files removed, nothing was published")
    assert store_contents(store) == []
    work = tmp_path / "cache" / "work"
    assert not work.exists() or not any(p.name.startswith("build-") for p in work.iterdir())


def test_disk_full_errors_name_the_file_system(tmp_path):
    e = host.disk_full_error(errno.ENOSPC, tmp_path / "missing" / "file", subject="x", step="convert")
    assert isinstance(e, DiskFull) and e.exit_code == 7
    mount, fstype = host.filesystem_of(tmp_path)
    assert f"({fstype} file system at {mount}, " in str(e) and "during step 'convert'" in str(e)
    assert host.is_disk_full(OSError(errno.EDQUOT, "quota")) and not host.is_disk_full(OSError(errno.EACCES, "x"))


def test_absurd_config_through_the_cli_is_one_line(tiny_llama, registry, tmp_path):
    model = copy_model(tiny_llama, tmp_path / "absurd")
    edit_config(model, hidden_size=10**9)
    proc = hive("plan", str(model), "--model-id", "test-org/absurd", "--recipe", "gguf-f16", "--registry", str(registry))
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode in (1, 7) and "hidden_size=1000000000" in line and "plausible" in line
