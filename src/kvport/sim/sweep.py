"""``kvport simulate --sweep``: the planner's questions, answered over a grid of deployments.

Each cell is one deployment (a P:D ratio, a shared-tier size, a link speed) replaying the same
trace; the answer is the cell with the most goodput per device (requests inside both SLO limits per
second, divided by the engines it took), ties going to fewer devices. Colocated cells (``0:N``
is written ``Nc``) compete in the same table, so "does disaggregation pay for this trace" is a row
of the answer, not a separate question.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvport.errors import SimInputError
from kvport.sim.deployment import Deployment, LinkSpec, TierSpec
from kvport.sim.engine import Simulator
from kvport.sim.results import summarize
from kvport.sim.trace import TraceRequest
from kvport.units import parse_size


@dataclass(frozen=True, slots=True)
class Ratio:
    prefill: int
    decode: int  # 0: colocated, ``prefill`` engines doing both

    @classmethod
    def parse(cls, text: str) -> Ratio:
        s = text.strip().lower()
        try:
            if s.endswith("c"):
                r = cls(int(s[:-1]), 0)
            else:
                p, d = s.split(":")
                r = cls(int(p), int(d))
        except ValueError as exc:
            raise SimInputError(f"--sweep ratio {text!r}: expected P:D (e.g. 1:2) or Nc (N colocated engines)") \
                from exc
        if r.prefill < 1 or r.decode < 0 or (r.decode == 0 and not s.endswith("c")):
            raise SimInputError(f"--sweep ratio {text!r}: needs >= 1 prefill and >= 1 decode engine (or Nc)")
        return r

    @property
    def label(self) -> str:
        return f"{self.prefill}c" if self.decode == 0 else f"{self.prefill}:{self.decode}"


@dataclass(frozen=True, slots=True)
class Grid:
    ratios: tuple[Ratio, ...]
    tier_bytes: tuple[int | None, ...] = (None,)  # the shared tier's capacity (None: as configured)
    link_bps: tuple[float | None, ...] = (None,)  # the hand-off link (None: as configured)

    @classmethod
    def parse(cls, text: str, parse_bandwidth: Callable[[str], float]) -> Grid:
        """``ratio=1:1,1:2,2c;tier=1TiB,2TiB;link=25Gbps,100Gbps`` (parts optional but ``ratio``)."""
        parts: dict[str, str] = {}
        for chunk in filter(None, (c.strip() for c in text.split(";"))):
            if "=" not in chunk:
                raise SimInputError(f"--sweep part {chunk!r}: expected name=values (ratio, tier, link)")
            k, v = chunk.split("=", 1)
            if k.strip() not in ("ratio", "tier", "link"):
                raise SimInputError(f"--sweep part {k.strip()!r}: expected ratio, tier or link")
            if k.strip() in parts:
                raise SimInputError(f"--sweep part {k.strip()!r} given twice")
            parts[k.strip()] = v
        if "ratio" not in parts:
            raise SimInputError("--sweep needs ratio=... (e.g. ratio=1:1,1:2,2:1,2c)")
        ratios = tuple(Ratio.parse(x) for x in parts["ratio"].split(",") if x.strip())
        tiers: tuple[int | None, ...] = tuple(parse_size(x.strip()) for x in parts["tier"].split(",")) \
            if "tier" in parts else (None,)
        links: tuple[float | None, ...] = tuple(parse_bandwidth(x.strip()) for x in parts["link"].split(",")) \
            if "link" in parts else (None,)
        if not ratios:
            raise SimInputError("--sweep ratio=: no ratio given")
        return cls(ratios, tiers, links)


def cell(base: Deployment, ratio: Ratio, tier_bytes: int | None, link_bps: float | None) -> Deployment:
    tiers: tuple[TierSpec, ...] = base.tiers
    if tier_bytes is not None:
        shared = [t for t in base.tiers if t.scope == "shared"]
        if not shared:
            raise SimInputError("--sweep tier=...: the deployment has no shared tier to size (give --tier)")
        tiers = tuple(replace(t, capacity_bytes=tier_bytes) if t is shared[-1] else t for t in base.tiers)
    link = base.link if link_bps is None else LinkSpec(link_bps, base.link.latency)
    if ratio.decode == 0:
        return replace(base, mode="colocated", prefill=ratio.prefill, decode=1, tiers=tiers, link=link)
    return replace(base, mode="pd", prefill=ratio.prefill, decode=ratio.decode, tiers=tiers, link=link)


def sweep(base: Deployment, grid: Grid, trace: Sequence[TraceRequest],
          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for ratio, tb, lb in itertools.product(grid.ratios, grid.tier_bytes, grid.link_bps):
        if ratio.decode == 0 and lb != grid.link_bps[0]:
            continue  # colocated engines hand nothing over: one cell whatever the link
        dep = cell(base, ratio, tb, lb)
        sim = Simulator(dep)
        s = summarize(sim, sim.run(trace))
        row = {"ratio": ratio.label, "mode": dep.mode, "devices": dep.devices,
               "shared_tier_bytes": tb,
               "link_bytes_per_second": None if dep.mode == "colocated" else dep.link.bandwidth,
               "goodput_rps": s["goodput_rps"], "goodput_rps_per_device": s["goodput_rps_per_device"],
               "slo_attainment": s["slo_attainment"], "ttft_p90_s": s["ttft_s"]["p90"],
               "tpot_p90_s": s["tpot_s"]["p90"], "hit_rate_tokens": s["hit_rate_tokens"]}
        rows.append(row)
        if progress is not None:
            progress(f"{ratio.label:>5} tier={tb} link={lb}: {row['goodput_rps_per_device']} req/s per device")
    best = max(rows, key=lambda r: (r["goodput_rps_per_device"], -r["devices"]))
    return {"cells": rows, "best": best}
