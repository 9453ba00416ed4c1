"""Which layout serves a host better: PD or colocated, from what was measured on it.

* **pd**: a prefill engine and a decode engine on cores of their own, kvport streaming each prompt's
  KV from one to the other, ``kvport proxy`` in front (:func:`kvport.deploy.vllm_serve.recipe`).
* **colocated**: one engine on every core (``kv_both``: kvport is its shared tier, so sessions and
  other engines still find their history), clients ask it directly.

Disaggregation pays when prefill and decode each have compute of their own to lose in interference;
on a CPU host it splits the cores, and a prompt's prefill runs on part of them. ``kvport bench pd``
measures both layouts end to end at several request rates (``results.e2e``); :func:`choose` takes
its figures when given (the layout with the higher goodput at the rate asked, the lower mean TTFT on
a tie) and otherwise says what is known: on this project's 2-core machine the colocated engine won
at every rate measured (0.2-1 req/s of 512-token shared prefixes and 128-token turns: mean TTFT
0.24-0.28 s against PD's 0.59-0.67 s, the prefill on one core taking 1.7x the colocated engine's
compute, docs/vllm.md), and a host not measured gets the colocated layout on fewer than :data:`PD_MIN_CPUS`
cores, PD above, with the reason that it was not measured.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvport.errors import UserInputError

LAYOUTS = ("pd", "colocated")
PD_MIN_CPUS = 8  # below this, each role of a CPU host's PD gets too few cores (2 measured: colocated wins)


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    name: str  # one of LAYOUTS
    why: str


def _rows(report: Mapping[str, Any]) -> dict[str, Any]:
    e2e = report.get("results", {}).get("e2e") if isinstance(report.get("results"), dict) else None
    rows = e2e.get("rates") if isinstance(e2e, dict) else None
    if report.get("suite") != "pd" or not isinstance(rows, dict) or not rows:
        raise UserInputError("not a kvport bench pd report with end-to-end rates (results.e2e.rates): "
                             "run kvport bench pd --json FILE")
    return rows


def from_report(report: Mapping[str, Any], rate: float | None = None) -> LayoutChoice:
    """The layout a ``kvport bench pd`` report measured better at the rate nearest ``rate`` (else at
    every rate it measured, the one that won more of them)."""
    rows = _rows(report)
    keys = sorted(rows, key=float)
    if rate is not None:
        keys = [min(keys, key=lambda k: abs(float(k) - rate))]
    wins = {"pd": 0, "colocated": 0}
    said = []
    for k in keys:
        pd, colo = rows[k].get("pd", {}), rows[k].get("colocated", {})
        g = (pd.get("goodput_rps"), colo.get("goodput_rps"))
        t = (pd.get("ttft_mean_s"), colo.get("ttft_mean_s"))
        if None in g or None in t:
            continue
        best = "pd" if (g[0], -t[0]) > (g[1], -t[1]) else "colocated"
        wins[best] += 1
        said.append(f"{k} req/s: goodput {g[0]:.3g} vs {g[1]:.3g} req/s, mean TTFT {t[0]:.3g} vs {t[1]:.3g} s "
                    f"(pd vs colocated)")
    if not said:
        raise UserInputError("the report's end-to-end rows have no goodput or TTFT to compare")
    name = "pd" if wins["pd"] > wins["colocated"] else "colocated"
    return LayoutChoice(name, f"measured by kvport bench pd: {'; '.join(said)}")


def choose(cpus: int | None = None, report: Mapping[str, Any] | Path | None = None,
           rate: float | None = None) -> LayoutChoice:
    """The better layout for a host of ``cpus`` cores (this one's when None): measured when a ``kvport
    bench pd`` report (or its path) is given, else the rule in the module docstring."""
    if report is not None:
        if isinstance(report, Path):
            try:
                report = json.loads(report.read_text())
            except (OSError, ValueError) as exc:
                raise UserInputError(f"cannot read the bench pd report {report}: {exc}") from None
            if not isinstance(report, dict):
                raise UserInputError("the bench pd report is not a JSON object")
        return from_report(report, rate)
    n = cpus if cpus is not None else (os.cpu_count() or 1)
    if n < PD_MIN_CPUS:
        return LayoutChoice("colocated", f"{n} cores: PD would run each prompt's prefill on part of them; on 2 cores "
                                   "kvport bench pd measured the colocated engine better at every rate (docs/vllm.md)"
                                   "; run it here to decide by measurement")
    return LayoutChoice("pd", f"{n} cores: each role keeps {n // 2} or more; not measured on this host -- run kvport "
                        "bench pd and pass its report to decide by measurement")
