"""Sizes in bytes: one parser and one formatter for every size the project reads or prints."""

from __future__ import annotations

import re

from .errors import ConfigError

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_BINARY = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": TIB, "p": 1 << 50}
_SIZE = re.compile(r"^\s*(\d{1,20}(?:\.\d{1,20})?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
MAX_SIZE = 1 << 60  # an exbibyte: beyond any disk or memory, and beyond what a float multiplies exactly


def parse_size(text: str | int, what: str = "size") -> int:
    """`12G`, `12GiB`, `800M`, `1.5g`, `5GB` or plain bytes (an int is taken as bytes). K/M/G/T/P alone or with
    iB are binary (`12G` = `12GiB`); with a bare B they are decimal (`12GB` = 12 * 10^9). A ConfigError naming
    `what` for anything else, for 0 and for sizes beyond an exbibyte."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(text if isinstance(text, str) else "")
        if m is None or m.group(3).lower() == "i":  # "12Gi" without the B is not a unit we read
            raise ConfigError(f"{what}={text!r} is not a size: use bytes or a number with K, M, G or T "
                              "(e.g. 12G, 12GiB, 800M, 5GB)")
        number, unit, suffix = float(m.group(1)), m.group(2).lower(), m.group(3).lower()
        decimal = suffix == "b" and unit != ""  # GB, MB: powers of 1000
        scale = 1000 ** " kmgtp".index(unit) if decimal else _BINARY[unit]
        value = int(number * scale)
    if value <= 0:
        raise ConfigError(f"{what}={text!r} is not a size: it must be more than 0 bytes")
    if value > MAX_SIZE:
        raise ConfigError(f"{what}={text!r} is not a plausible size (more than an exbibyte)")
    return value


def human_bytes(n: int) -> str:
    """1.5 GiB, 800.0 MiB; exact integer arithmetic for sizes no float can hold (an absurd header's)."""
    n = int(n)
    if n < 0:
        return f"-{human_bytes(-n)}"
    if n < KIB:
        return f"{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for i, unit in enumerate(units, start=1):
        if n < 1 << (10 * (i + 1)) or unit == units[-1]:
            whole = n >> (10 * i)
            if whole >= 1 << 40:  # beyond exbibytes by far: say how far, without a float
                return f"about 2^{n.bit_length() - 1} B"
            tenths = ((n * 10) >> (10 * i)) % 10
            return f"{whole}.{tenths} {unit}"
    raise AssertionError("unreachable")
