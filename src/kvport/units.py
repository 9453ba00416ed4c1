"""Parsing and printing of byte sizes, bandwidths and durations.

Sizes accept SI (kB, MB, GB, TB = powers of 1000) and IEC (KiB, MiB, GiB, TiB = powers of 1024)
suffixes, case-insensitively for the prefix letter, plus plain integers (bytes). Bandwidths accept a
size per second (``20GiB/s``, ``25 GB/s``, ``400MB/s``) or bits per second (``100Gbps``,
``100 Gbit/s``, ``25gbps``); the result is always bytes per second.
"""

from __future__ import annotations

import math
import re

from kvport.errors import UnitError

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}
_BIT_UNITS: dict[str, int] = {
    "bps": 1,
    "kbps": 1000,
    "mbps": 1000**2,
    "gbps": 1000**3,
    "tbps": 1000**4,
    "kbit/s": 1000,
    "mbit/s": 1000**2,
    "gbit/s": 1000**3,
    "tbit/s": 1000**4,
}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")
_SIZE_CHOICES = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"
_BW_CHOICES = "GiB/s, GB/s, MB/s, MiB/s, Gbps, Mbps, Gbit/s"


def _split(text: str, what: str, choices: str) -> tuple[float, str]:
    m = _NUM.match(str(text))
    if not m:
        raise UnitError(f"cannot parse {what} {text!r}: expected a number and a unit ({choices})")
    value = float(m.group(1))
    if not math.isfinite(value) or value <= 0:
        raise UnitError(f"{what} must be positive, got {text!r}")
    return value, m.group(2).lower()


def parse_size(text: str | int) -> int:
    """``"80GiB"`` -> 85899345920. Must be at least one byte: a fraction that rounds to 0 bytes
    (``"0.4"``) is refused, never returned as 0 (callers read 0 as "unset" or divide by it)."""
    if isinstance(text, int):
        if text <= 0:
            raise UnitError(f"size must be positive, got {text}")
        return text
    value, unit = _split(text, "size", _SIZE_CHOICES)
    if unit not in _SIZE_UNITS:
        raise UnitError(f"unknown size unit {unit!r} in {text!r}: expected one of {_SIZE_CHOICES}")
    nbytes = value * _SIZE_UNITS[unit]
    if not math.isfinite(nbytes):
        raise UnitError(f"size {text!r} is too large")
    if round(nbytes) < 1:
        raise UnitError(f"size {text!r} is less than one byte: sizes must be positive (a unit missing? "
                        f"expected one of {_SIZE_CHOICES})")
    return round(nbytes)


def parse_bandwidth(text: str | float) -> float:
    """``"20GiB/s"`` -> bytes/s; ``"100Gbps"`` -> 12.5e9 bytes/s. Must be positive."""
    if isinstance(text, int | float):
        if not math.isfinite(text) or text <= 0:
            raise UnitError(f"bandwidth must be positive, got {text}")
        return float(text)
    value, unit = _split(text, "bandwidth", _BW_CHOICES)
    if unit in _BIT_UNITS:
        bps = value * _BIT_UNITS[unit] / 8.0
    elif unit.endswith("/s") and unit[:-2] in _SIZE_UNITS and unit[:-2] != "":
        bps = value * _SIZE_UNITS[unit[:-2]]
    else:
        raise UnitError(f"unknown bandwidth unit {unit!r} in {text!r}: expected one of {_BW_CHOICES}")
    if not math.isfinite(bps):
        raise UnitError(f"bandwidth {text!r} is too large")
    if bps < 1.0:
        raise UnitError(f"bandwidth {text!r} is less than one byte per second: a unit missing? "
                        f"expected one of {_BW_CHOICES}")
    return bps


def format_bytes(n: float) -> str:
    """IEC formatting: 8589934592 -> '8.00 GiB'."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"
