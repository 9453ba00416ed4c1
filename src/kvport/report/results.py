"""The benchmark reports a page is drawn from: read, checked, and asked for fields that may be missing.

A report is the JSON ``kvport bench SUITE --json PATH`` writes (:class:`~kvport.bench.harness.Report`).
Whatever cannot be trusted is said, never guessed: a file that is not such a report is listed with
its reason and left out; a report of another format or kvport version is used with that noted on
its figures; a field a figure needs and the report lacks makes the figure *unknown*, naming the
field (:class:`Fields`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvport import __version__
from kvport.bench.harness import REPORT_FORMAT

MAX_REPORT_BYTES = 64 << 20  # a report is kilobytes; anything this large is not one


@dataclass(frozen=True, slots=True)
class SuiteReport:
    suite: str
    data: dict[str, Any]
    path: Path | None = None
    notes: tuple[str, ...] = ()  # another format or version: shown beside every figure drawn from it

    @property
    def conditions(self) -> dict[str, Any]:
        c = self.data.get("conditions")
        return c if isinstance(c, dict) else {}

    @property
    def limits(self) -> dict[str, Any]:
        lim = self.data.get("limits")
        return lim if isinstance(lim, dict) else {}

    @property
    def results(self) -> dict[str, Any]:
        r = self.data.get("results")
        return r if isinstance(r, dict) else {}

    def summary(self) -> str:
        """Mode, date, commit, CPU and load in one line; what the report lacks reads ``unknown``."""
        c = self.conditions

        def val(key: str) -> str:
            v = c.get(key)
            return "unknown" if v is None else str(v)

        start, end = c.get("loadavg_start"), c.get("loadavg_end")
        a = finite(start[0]) if isinstance(start, list) and start else None
        b = finite(end[0]) if isinstance(end, list) and end else None
        load = f"{a:.2f} -> {b:.2f}" if a is not None and b is not None else "unknown"
        return (f"mode {val('mode')}, {val('started')}, commit {val('commit')}, {val('cpu')} "
                f"({val('cpu_count')} cores, {val('cpu_isa')}, memops {val('memops')}), load {load}")


@dataclass(slots=True)
class Inputs:
    """The reports read (the newest of each suite) and the files refused, with why."""

    reports: dict[str, SuiteReport] = field(default_factory=dict)
    refused: list[tuple[str, str]] = field(default_factory=list)

    def add(self, rep: SuiteReport) -> None:
        old = self.reports.get(rep.suite)
        if old is None or str(rep.conditions.get("started", "")) >= str(old.conditions.get("started", "")):
            self.reports[rep.suite] = rep


def parse(data: object, path: Path | None = None) -> SuiteReport:
    """One report's JSON as a :class:`SuiteReport`; ValueError (the reason) when it is not a report."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if "suite" not in data and "per_turn" in data and "outputs_equal_baseline" in data:
        # ``kvport demo --json``: the demo's summary is its results
        cond = data.get("conditions")
        data = {"format": REPORT_FORMAT, "suite": "demo", "conditions": cond if isinstance(cond, dict) else {},
                "limits": {}, "results": data}
    suite = data.get("suite")
    if not isinstance(suite, str) or not suite:
        raise ValueError("no 'suite' name: not a kvport bench report")
    if not isinstance(data.get("results"), dict):
        raise ValueError(f"suite {suite!r} has no 'results' object")
    notes: list[str] = []
    fmt = data.get("format")
    if fmt is None:
        notes.append("no format stamp (written before kvport stamped its reports)")
    elif fmt != REPORT_FORMAT:
        notes.append(f"report format {fmt!r}, this kvport reads format {REPORT_FORMAT}: fields may differ")
    cond = data.get("conditions") if isinstance(data.get("conditions"), dict) else {}
    versions = cond.get("versions") if isinstance(cond, dict) else None
    made_by = versions.get("kvport") if isinstance(versions, dict) else None
    if made_by is None:
        notes.append("the kvport version that wrote it is unknown")
    elif made_by != __version__:
        notes.append(f"written by kvport {made_by} (this is {__version__})")
    return SuiteReport(suite, data, path, tuple(notes))


def _files(paths: Iterable[Path]) -> Iterator[Path]:
    for p in paths:
        if p.is_dir():
            yield from sorted(p.glob("*.json"))
        else:
            yield p


def load(paths: Iterable[Path]) -> Inputs:
    """Every report in ``paths`` (files, or folders of ``*.json``); a bad file is refused with its reason."""
    out = Inputs()
    for path in _files(paths):
        try:
            if path.stat().st_size > MAX_REPORT_BYTES:
                raise ValueError(f"{path.stat().st_size} bytes: larger than any report ({MAX_REPORT_BYTES})")
            data = json.loads(path.read_text())
            out.add(parse(data, path))
        except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            out.refused.append((str(path), str(exc) or type(exc).__name__))
    return out


def finite(v: object) -> float | None:
    """``v`` as a finite float, or None: not a number, a bool, NaN, an infinity, or an integer too large
    for a float (JSON allows 10**400) -- the one reading of a number the report trusts."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


class Fields:
    """Field lookups for one figure, remembering every field that was missing or not a number.

    ``num("results.tcp_gbps")`` is the number, or None (recorded in :attr:`missing`); a figure
    with missing fields it needs is drawn as unknown, naming them."""

    def __init__(self, rep: SuiteReport) -> None:
        self.rep = rep
        self.missing: list[str] = []

    def get(self, dotted: str, default: Any = None, *, need: bool = True) -> Any:
        node: Any = self.rep.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                if need:
                    self.missing.append(f"{self.rep.suite}: {dotted}")
                return default
            node = node[part]
        return node

    def num(self, dotted: str, *, need: bool = True) -> float | None:
        v = self.get(dotted, need=need)
        if v is None:
            return None
        f = finite(v)
        if f is None and need:
            self.missing.append(f"{self.rep.suite}: {dotted} (not a finite number: {str(v)[:40]})")
        return f
