"""Which accelerator this host (or container) has, for `pull --target auto`, and which runtime profile serves it.

Detection reads what drivers expose, never a driver library: device nodes, /proc and /sys entries, and the
vendors' command-line tools on PATH, each found item kept as evidence for the explanation pull prints:

- Cloud AI 100: `/dev/qaic_*` (the qaic kernel driver's nodes), or the platform tool `qaic-util`.
- NVIDIA: `/proc/driver/nvidia/gpus/*` (one per GPU), `/dev/nvidia<N>`, or `nvidia-smi` on PATH.
- AMD: `/dev/kfd` with a GPU node in the KFD topology (`simd_count` > 0), or `rocm-smi` / `amd-smi` on PATH.
- Intel GPU: a DRM render node whose PCI vendor is 0x8086 *and* the Level Zero loader (`libze_loader.so.1`,
  which vLLM's XPU backend needs); an integrated GPU without it does not count.
- otherwise the CPU.

The choice then follows NIM's rule: the detected vendor's profiles first, the most specific role first
(`qaic`, then `vllm`, then `transformers`), keeping only those a published artifact of the model serves;
when the model has nothing for that accelerator, the CPU tier (llama.cpp, then transformers). Among the
recipes that serve the chosen profile, its `recipe_preference` in registry.yaml decides (pull.choose).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VENDOR_NAMES = {"qualcomm": "Cloud AI 100", "nvidia": "NVIDIA GPU", "amd": "AMD GPU", "intel": "Intel GPU",
                "cpu": "CPU"}
ROLE_ORDER = ("qaic", "vllm", "transformers")  # an accelerator's profiles, most specific first
CPU_TIER_ROLES = ("gguf", "transformers")  # the CPU tier: llama.cpp first
LEVEL_ZERO_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "usr/local/lib", "opt/intel/oneapi/lib")


@dataclass(frozen=True)
class Detected:
    vendor: str  # a runtime profile vendor: qualcomm | nvidia | amd | intel | cpu
    devices: int
    evidence: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        if self.vendor == "cpu":
            return "no accelerator (no /dev/qaic_*, NVIDIA driver, /dev/kfd GPU or Intel GPU with Level Zero), the CPU"
        count = f"{self.devices} x " if self.devices > 1 else ""
        return f"{count}{VENDOR_NAMES[self.vendor]} ({'; '.join(self.evidence)})"


def _tool(name: str, path: str | None) -> str | None:
    return shutil.which(name, path=path)


def detect(root: Path = Path("/"), path: str | None = None) -> Detected:
    """The accelerator visible under `root` (a container's view of /dev, /proc, /sys) with tools on `path`
    (default: $PATH). Tests pass a directory tree and a bin directory of their own."""
    dev, proc, sys_ = root / "dev", root / "proc", root / "sys"

    qaic = sorted(dev.glob("qaic_*"))
    util = _tool("qaic-util", path) or next((str(p) for p in [root / "opt/qti-aic/tools/qaic-util"] if p.is_file()), None)
    if qaic or util:
        ev = ([f"{len(qaic)} device node(s) {qaic[0].name}..." if len(qaic) > 1 else f"device node {qaic[0].name}"]
              if qaic else []) + ([f"platform tool {util}"] if util else [])
        return Detected("qualcomm", max(1, len(qaic)), tuple(ev))

    gpus = sorted((proc / "driver/nvidia/gpus").glob("*"))
    nodes = sorted(p for p in dev.glob("nvidia[0-9]*"))
    smi = _tool("nvidia-smi", path)
    if gpus or nodes or smi:
        ev = ([f"/proc/driver/nvidia/gpus lists {len(gpus)}"] if gpus else []) + (
            [f"{len(nodes)} /dev/nvidia<N> node(s)"] if nodes else []) + ([f"{smi} on PATH"] if smi else [])
        return Detected("nvidia", max(1, len(gpus) or len(nodes)), tuple(ev))

    kfd_gpus = 0
    for props in (sys_ / "class/kfd/kfd/topology/nodes").glob("*/properties"):
        try:
            fields = dict(line.split(None, 1) for line in props.read_text().splitlines() if " " in line)
            kfd_gpus += int(fields.get("simd_count", "0").strip()) > 0
        except (OSError, ValueError):
            continue
    rocm = _tool("rocm-smi", path) or _tool("amd-smi", path)
    if ((dev / "kfd").exists() and kfd_gpus) or rocm:
        ev = ([f"/dev/kfd with {kfd_gpus} GPU node(s) in the KFD topology"] if kfd_gpus else []) + (
            [f"{rocm} on PATH"] if rocm else [])
        return Detected("amd", max(1, kfd_gpus), tuple(ev))

    intel = []
    for node in sorted((sys_ / "class/drm").glob("renderD*")):
        try:
            if (node / "device/vendor").read_text().strip().lower() == "0x8086":
                intel.append(node.name)
        except OSError:
            continue
    level_zero = next((root / d / "libze_loader.so.1" for d in LEVEL_ZERO_DIRS
                       if (root / d / "libze_loader.so.1").exists()), None)
    if intel and level_zero is not None:
        return Detected("intel", len(intel), (f"render node(s) {', '.join(intel)} of PCI vendor 0x8086",
                                              f"Level Zero loader {level_zero}"))
    return Detected("cpu", 0, ("no accelerator",))


def choose_profile(detected: Detected, profiles: dict[str, dict[str, Any]], served: Iterable[str]) -> tuple[str, str]:
    """(runtime profile id, why): the detected vendor's most specific active profile that a published
    artifact serves, else the CPU tier's; `served` are the profile ids the model's published artifacts name."""
    from ..core.errors import HiveError

    served = set(served)

    def ranked(vendor: str, roles: tuple[str, ...]) -> list[dict[str, Any]]:
        mine = [p for p in profiles.values() if p.get("vendor") == vendor and p.get("active", True)]
        return sorted((p for p in mine if p.get("role") in roles), key=lambda p: roles.index(p["role"]))

    own = ranked(detected.vendor, CPU_TIER_ROLES if detected.vendor == "cpu" else ROLE_ORDER)
    for p in own:
        if p["id"] in served:
            return p["id"], (f"{VENDOR_NAMES[detected.vendor]}'s {p['role']} profile, first of its profiles that a "
                             "published artifact of the model serves")
    if detected.vendor != "cpu":
        for p in ranked("cpu", CPU_TIER_ROLES):
            if p["id"] in served:
                names = ", ".join(q["id"] for q in own) or "none"
                return p["id"], (f"nothing published serves {VENDOR_NAMES[detected.vendor]}'s profiles ({names}): "
                                 f"the CPU tier, {p['role']}")
    raise HiveError(f"--target auto found {detected.describe()}, but nothing published serves "
                    f"{', '.join(p['id'] for p in own) or 'its profiles'}"
                    + ("" if detected.vendor == "cpu" else " or the CPU tier")
                    + f" (published for: {', '.join(sorted(served)) or 'nothing'})")


__all__ = ["Detected", "choose_profile", "detect"]
