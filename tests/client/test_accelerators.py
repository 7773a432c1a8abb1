"""`--target auto`: what each vendor's driver leaves under /dev, /proc and /sys (fake trees here, as a container
with that accelerator would show them) and its tools on PATH, the profile chosen from what is published, and
the explanation; on this host, the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.client.accelerators import Detected, choose_profile, detect
from pipelines.config.registry import load_registry
from pipelines.core.errors import HiveError


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def _tools(root: Path, *names: str) -> str:
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for n in names:
        (bin_dir / n).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / n).chmod(0o755)
    return str(bin_dir)


KFD_GPU = "cpu_cores_count 0\nsimd_count 304\narray_count 4\n"
KFD_CPU = "cpu_cores_count 64\nsimd_count 0\n"

CASES = {
    "nvidia-proc": ({"proc/driver/nvidia/gpus/0000:01:00.0/information": "Model: H100",
                     "proc/driver/nvidia/gpus/0000:02:00.0/information": "Model: H100"}, (), "nvidia", 2),
    "nvidia-smi-only": ({}, ("nvidia-smi",), "nvidia", 1),
    "nvidia-dev-nodes": ({"dev/nvidia0": "", "dev/nvidiactl": ""}, (), "nvidia", 1),
    "amd-kfd": ({"dev/kfd": "", "sys/class/kfd/kfd/topology/nodes/0/properties": KFD_CPU,
                 "sys/class/kfd/kfd/topology/nodes/1/properties": KFD_GPU}, (), "amd", 1),
    "amd-rocm-smi": ({}, ("rocm-smi",), "amd", 1),
    "intel-level-zero": ({"sys/class/drm/renderD128/device/vendor": "0x8086\n",
                          "usr/lib/x86_64-linux-gnu/libze_loader.so.1": ""}, (), "intel", 1),
    "qaic-nodes": ({"dev/qaic_aic100_0": "", "dev/qaic_aic100_1": ""}, (), "qualcomm", 2),
    "qaic-util": ({"opt/qti-aic/tools/qaic-util": ""}, (), "qualcomm", 1),
    # not accelerators: an Intel iGPU without Level Zero, a KFD with only CPU nodes, nothing at all
    "intel-igpu-no-level-zero": ({"sys/class/drm/renderD128/device/vendor": "0x8086\n"}, (), "cpu", 0),
    "kfd-cpu-nodes-only": ({"dev/kfd": "", "sys/class/kfd/kfd/topology/nodes/0/properties": KFD_CPU}, (), "cpu", 0),
    "bare": ({}, (), "cpu", 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_detection_from_what_drivers_expose(name, tmp_path):
    files, tools, vendor, devices = CASES[name]
    root = _tree(tmp_path / "root", files)
    found = detect(root, path=_tools(tmp_path, *tools))
    assert (found.vendor, found.devices) == (vendor, devices), found
    assert found.evidence and found.describe()
    if vendor != "cpu":
        assert any(part in found.describe() for part in ("/proc", "/dev", "on PATH", "render node", "tool", "node"))


@pytest.fixture(scope="module")
def profiles():
    reg, _ = load_registry(None)
    return {p.id: p.model_dump(mode="json") for p in reg.runtime_profiles}


def test_the_vendor_s_most_specific_profile_with_an_artifact_wins(profiles):
    gpu = Detected("nvidia", 1, ("nvidia-smi on PATH",))
    assert choose_profile(gpu, profiles, {"vllm-cu121", "transformers-cu121", "llm-llamacpp-cpu"})[0] == "vllm-cu121"
    assert choose_profile(gpu, profiles, {"transformers-cu121", "llm-llamacpp-cpu"})[0] == "transformers-cu121"
    profile, why = choose_profile(gpu, profiles, {"llm-llamacpp-cpu"})
    assert profile == "llm-llamacpp-cpu" and "nothing published serves NVIDIA GPU's profiles" in why
    assert choose_profile(Detected("qualcomm", 1), profiles, {"vllm-qaic", "llm-llamacpp-cpu"})[0] == "vllm-qaic"
    assert choose_profile(Detected("amd", 1), profiles, {"vllm-rocm", "vllm-cu121"})[0] == "vllm-rocm"
    assert choose_profile(Detected("intel", 1), profiles, {"vllm-xpu", "ipex-xe"})[0] == "vllm-xpu"
    cpu = Detected("cpu", 0)
    assert choose_profile(cpu, profiles, {"llm-llamacpp-cpu", "transformers-cpu", "vllm-cu121"})[0] == "llm-llamacpp-cpu"
    with pytest.raises(HiveError, match=r"found no accelerator .* nothing published serves llm-llamacpp-cpu, "
                                        r"transformers-cpu \(published for: vllm-cu121\)") as ei:
        choose_profile(cpu, profiles, {"vllm-cu121"})
    assert "\n" not in str(ei.value)


def test_inactive_profiles_are_never_chosen(profiles):
    amd = Detected("amd", 1)
    # vllm-rocm60 is kept in the registry deactivated
    assert choose_profile(amd, profiles, {"vllm-rocm60", "llm-llamacpp-cpu"})[0] == "llm-llamacpp-cpu"
