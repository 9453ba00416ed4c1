"""The calibration profile: measured costs of this machine, as plain frozen values, and its JSON file.

Units: seconds, bytes, bytes per second. Every measured entry carries ``measured_at`` (unix seconds),
so staleness is judged per entry (a link refreshed by live observations is fresh again even when the
prefill numbers are old).

Prefill cost of computing tokens ``[s, e)`` with ``s`` tokens already cached (``q = e - s``)::

    t(s, e) = scale * (a + x*[s > 0] + b*q + c*q^2 + d*q*s)        a, x, b, c, d >= 0

``a`` is per-forward overhead, ``x`` the extra fixed cost of a forward that attends to a cache
(cache bookkeeping, masks), ``b`` the per-token linear work (MLPs, projections), ``c`` the causal
self-attention among the new tokens, ``d`` their attention to the cached context. A full prefill is
``t(0, n) = a + b n + c n^2``; ``scale`` is the live correction (EMA of observed / predicted, 1.0 when
calibrated). A link or tier moves ``n`` bytes in ``latency + n / bandwidth``.

File layout (``version`` 1)::

    {"version": 1, "machine": "...", "created": 1.7e9,
     "prefill": {"model_id": ..., "threads": 2, "a": .., "x": .., "b": .., "c": .., "d": .., "scale": 1.0,
                 "measured_at": .., "points": [[start, end, seconds], ...]} | null,
     "links": [{"name": "loopback", "kind": "peer", "bandwidth": .., "latency": .., "measured_at": ..,
                "source": "calibrated"}, ...],
     "codecs": [{"name": "int8", "ratio": .., "encode_bps": .., "decode_bps": .., "quality_cost": ..,
                 "measured_at": .., "quality_source": "<eval result file>: code +0.02%, ..."}, ...],
     "install_bps": .. | null}
"""

from __future__ import annotations

import enum
import json
import math
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvport.errors import ProfileError

PROFILE_VERSION = 1


def _finite_pos(name: str, v: object, *, zero_ok: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ProfileError(f"{name} must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f) or f < 0 or (f == 0 and not zero_ok):
        raise ProfileError(f"{name} must be {'>= 0' if zero_ok else '> 0'} and finite, got {v!r}")
    return f


def machine_id() -> str:
    """What makes a profile belong to this machine: CPU model and count."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} x{os.cpu_count()}"


class LinkKind(enum.Enum):
    TIER = "tier"  # a local store tier (host RAM, disk, redis)
    PEER = "peer"  # another worker over a network link


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    start: int
    end: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillModel:
    model_id: str
    threads: int
    a: float
    b: float
    c: float
    d: float
    measured_at: float
    scale: float = 1.0
    points: tuple[PrefillPoint, ...] = ()
    x: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d", "x"):
            _finite_pos(f"prefill.{name}", getattr(self, name), zero_ok=True)
        _finite_pos("prefill.scale", self.scale)
        if self.a + self.b + self.c + self.d <= 0:
            raise ProfileError("prefill model predicts zero time for everything")

    def raw_seconds(self, start: int, end: int) -> float:
        """Model time of tokens [start, end) without the live ``scale``."""
        if end <= start:
            return 0.0
        q = end - start
        return self.a + (self.x if start > 0 else 0.0) + self.b * q + self.c * q * q + self.d * q * start

    def seconds(self, start: int, end: int) -> float:
        return self.scale * self.raw_seconds(start, end)


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    kind: LinkKind
    bandwidth: float  # bytes/s
    latency: float  # seconds per request before the first byte
    measured_at: float
    source: str = "calibrated"  # or "observed" (created by a live observation), "what-if"

    def __post_init__(self) -> None:
        if not self.name:
            raise ProfileError("link name must not be empty")
        _finite_pos(f"link {self.name}.bandwidth", self.bandwidth)
        _finite_pos(f"link {self.name}.latency", self.latency, zero_ok=True)

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True, slots=True)
class CodecCost:
    name: str
    ratio: float  # raw bytes / encoded bytes
    encode_bps: float  # raw bytes encoded per second
    decode_bps: float  # raw bytes decoded per second
    quality_cost: float  # relative perplexity increase (0 for lossless), see planner.quality
    measured_at: float
    quality_source: str = ""  # the eval result the quality cost comes from

    def __post_init__(self) -> None:
        _finite_pos(f"codec {self.name}.ratio", self.ratio)
        _finite_pos(f"codec {self.name}.encode_bps", self.encode_bps)
        _finite_pos(f"codec {self.name}.decode_bps", self.decode_bps)
        _finite_pos(f"codec {self.name}.quality_cost", self.quality_cost, zero_ok=True)


@dataclass(frozen=True, slots=True)
class Profile:
    machine: str
    created: float
    prefill: PrefillModel | None = None
    links: tuple[Link, ...] = ()
    codecs: tuple[CodecCost, ...] = ()
    install_bps: float | None = None  # received bytes placed into the engine's cache per second

    def __post_init__(self) -> None:
        names = [lk.name for lk in self.links]
        if len(set(names)) != len(names):
            raise ProfileError(f"duplicate link names in profile: {names}")
        if self.install_bps is not None:
            _finite_pos("install_bps", self.install_bps)

    def link(self, name: str) -> Link | None:
        return next((lk for lk in self.links if lk.name == name), None)

    def codec(self, name: str) -> CodecCost | None:
        return next((c for c in self.codecs if c.name == name), None)

    def with_link(self, link: Link) -> Profile:
        return replace(self, links=(*(lk for lk in self.links if lk.name != link.name), link))

    def with_prefill(self, prefill: PrefillModel | None) -> Profile:
        return replace(self, prefill=prefill)

    # ------------------------------------------------------------------ JSON
    def as_dict(self) -> dict[str, Any]:
        pf = None
        if self.prefill is not None:
            p = self.prefill
            pf = {"model_id": p.model_id, "threads": p.threads, "a": p.a, "x": p.x, "b": p.b, "c": p.c, "d": p.d,
                  "scale": p.scale, "measured_at": p.measured_at,
                  "points": [[pt.start, pt.end, pt.seconds] for pt in p.points]}
        return {
            "version": PROFILE_VERSION, "machine": self.machine, "created": self.created, "prefill": pf,
            "links": [{"name": lk.name, "kind": lk.kind.value, "bandwidth": lk.bandwidth, "latency": lk.latency,
                       "measured_at": lk.measured_at, "source": lk.source} for lk in self.links],
            "codecs": [{"name": c.name, "ratio": c.ratio, "encode_bps": c.encode_bps, "decode_bps": c.decode_bps,
                        "quality_cost": c.quality_cost, "measured_at": c.measured_at,
                        "quality_source": c.quality_source} for c in self.codecs],
            "install_bps": self.install_bps,
        }

    @classmethod
    def from_dict(cls, d: object) -> Profile:
        if not isinstance(d, dict):
            raise ProfileError("profile must be a JSON object")
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile version {d.get('version')!r} is not {PROFILE_VERSION}: run `kvport calibrate`")
        try:
            pf = d.get("prefill")
            prefill = None
            if pf is not None:
                prefill = PrefillModel(
                    model_id=str(pf["model_id"]), threads=int(pf["threads"]), a=pf["a"], b=pf["b"], c=pf["c"],
                    d=pf["d"], x=pf.get("x", 0.0), scale=pf.get("scale", 1.0), measured_at=float(pf["measured_at"]),
                    points=tuple(PrefillPoint(int(s), int(e), float(t)) for s, e, t in pf.get("points", [])))
            links = tuple(Link(name=str(lk["name"]), kind=LinkKind(lk["kind"]), bandwidth=lk["bandwidth"],
                               latency=lk["latency"], measured_at=float(lk["measured_at"]),
                               source=str(lk.get("source", "calibrated"))) for lk in d.get("links", []))
            codecs = tuple(CodecCost(name=str(c["name"]), ratio=c["ratio"], encode_bps=c["encode_bps"],
                                     decode_bps=c["decode_bps"], quality_cost=c["quality_cost"],
                                     measured_at=float(c["measured_at"]),
                                     quality_source=str(c.get("quality_source", ""))) for c in d.get("codecs", []))
            return cls(machine=str(d["machine"]), created=float(d["created"]), prefill=prefill, links=links,
                       codecs=codecs, install_bps=d.get("install_bps"))
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"malformed profile: {type(exc).__name__}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Atomic: written to a sibling temp file, then renamed over ``path``."""
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
            tmp.replace(p)
        except OSError as exc:
            raise ProfileError(f"cannot write profile {p}: {exc.strerror or exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        try:
            raw = p.read_text()
        except FileNotFoundError as exc:
            raise ProfileError(f"no calibration profile at {p}: run `kvport calibrate`") from exc
        except OSError as exc:
            raise ProfileError(f"cannot read profile {p}: {exc.strerror or exc}") from exc
        try:
            return cls.from_dict(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{p}: malformed profile JSON ({exc})") from exc
