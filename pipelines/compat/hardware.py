"""`--hardware vendor[-model][-<N>gb]`: which vendor's profiles to route to and how much memory a device has."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.errors import HiveError

# Device memory in GB for the models we know; `-<N>gb` overrides, and a bare vendor gets its default.
KNOWN_DEVICES: dict[str, dict[str, float]] = {
    "nvidia": {"t4": 16, "a10": 24, "a10g": 24, "l4": 24, "l40s": 48, "a100": 80, "h100": 80, "h200": 141, "b200": 192},
    "amd": {"mi210": 64, "mi250": 128, "mi250x": 128, "mi300x": 192, "mi325x": 256},
    "intel": {"max-1550": 128, "max-1100": 48, "arc-a770": 16, "b580": 12},
    "qaic": {"ai100": 32, "ai100-ultra": 128, "ai100-standard": 16},
    "cpu": {},
}
DEFAULT_DEVICE = {"nvidia": "a100", "amd": "mi300x", "intel": "max-1550", "qaic": "ai100", "cpu": None}
PROFILE_VENDOR = {"nvidia": "nvidia", "amd": "amd", "intel": "intel", "cpu": "cpu", "qaic": "qualcomm"}


def hardware_for_vendor(profile_vendor: str) -> str:
    """The `--hardware` spec (the vendor's default device) that routes to a runtime profile vendor."""
    return next(hw for hw, v in PROFILE_VENDOR.items() if v == profile_vendor)


@dataclass(frozen=True)
class Hardware:
    spec: str
    vendor: str  # nvidia | amd | intel | cpu | qaic
    model: str | None
    memory_gb: float | None

    @property
    def profile_vendor(self) -> str:
        return PROFILE_VENDOR[self.vendor]


def parse_hardware(spec: str) -> Hardware:
    s = spec.strip().lower()
    vendor, dash, rest = s.partition("-")
    if vendor not in KNOWN_DEVICES or (dash and not rest):
        raise HiveError(f"unknown hardware {spec!r}: expected vendor[-model][-<N>gb] with vendor one of "
                        f"{', '.join(KNOWN_DEVICES)} (e.g. nvidia-a100-80gb, amd-mi300x-192gb, intel-max-1550, cpu, qaic-ai100)")
    memory = None
    m = re.search(r"(?:^|-)(\d+(?:\.\d+)?)gb$", rest)
    if m:
        memory = float(m.group(1))
        rest = rest[: m.start()].rstrip("-")
    model = rest or DEFAULT_DEVICE[vendor]
    if memory is None and model is not None:
        if model not in KNOWN_DEVICES[vendor]:
            known = ", ".join(KNOWN_DEVICES[vendor]) or "none"
            raise HiveError(f"unknown {vendor} device {model!r} (known: {known}; or give its memory: {vendor}-{model}-<N>gb)")
        memory = KNOWN_DEVICES[vendor][model]
    return Hardware(spec=s, vendor=vendor, model=model, memory_gb=memory)
