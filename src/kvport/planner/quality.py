"""Codec quality costs for the planner, taken from ``kvport eval quality`` result files.

A lossy codec's *quality cost* is the relative perplexity increase it causes on the reference model,
the worst over the text sets the result measured (code and prose by default)::

    cost = max(0, max over sets s of ppl_delta_pct_s) / 100

A negative delta (the codec happened to help on those windows: noise) counts as 0. A lossless codec
(``Codec.lossless``: ``raw``, ``lossless``) costs 0 by construction and needs no measurement. Costs
are looked up by the codec's *key* (:func:`kvport.codec.codec_key`: id and params), so a result for
``kivi4(group=128)`` says nothing about ``kivi4`` at its default group; a codec with no result of its
own key is left out of the profile.

Sources: :func:`load_results` reads one or more result files (``kvport eval quality --json PATH``);
a codec measured in several files takes the last file's figure. :func:`default_results` is the
file shipped with kvport (``quality_smollm2-135m.json``, package data): one real ``kvport eval
quality`` run of every registered codec at the CLI's defaults, its provenance (date, command,
commit) inside. Every file must describe one model; calibration checks it is the profiled one.

Result file, as ``kvport eval quality`` writes it (other fields are kept but not read)::

    {"provenance": {"date": .., "command": .., "commit": ..},
     "conditions": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "tokens_per_window": 1024,
                    "windows_per_set": 4, "kv_dtype": "fp32", ...},
     "codecs": {"int8": {"codec": "int8", "key": "int8", "ppl_delta_pct_code": 0.02,
                         "ppl_delta_pct_prose": 0.02, ...}, ...}}

Any file that does not read as that raises :class:`~kvport.errors.ProfileError` (one line, naming
the file and the field).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvport.errors import ProfileError

DEFAULT_RESULTS = "quality_smollm2-135m.json"
_DELTA = "ppl_delta_pct_"


@dataclass(frozen=True, slots=True)
class QualityCost:
    key: str  # codec key: "int8", "kivi4(group=128)"
    cost: float  # relative perplexity increase, worst text set, >= 0
    source: str  # where the figure comes from, one line

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cost) and self.cost >= 0):
            raise ProfileError(f"quality cost of {self.key} must be a finite number >= 0, got {self.cost!r}")


@dataclass(frozen=True, slots=True)
class QualityTable:
    """Measured costs by codec key, for one model."""

    model: str
    costs: Mapping[str, QualityCost] = field(default_factory=dict)
    files: tuple[str, ...] = ()

    def lookup(self, key: str, lossless: bool) -> QualityCost | None:
        """The cost of the codec ``key``; 0 for a lossless codec; None when nothing measured it."""
        if lossless:
            return QualityCost(key, 0.0, "lossless: 0 by construction")
        return self.costs.get(key)

    def why_missing(self, key: str) -> str:
        """One line: why ``key`` has no cost (and which keys of the same codec were measured)."""
        codec_id = key.split("(", 1)[0]
        near = sorted(k for k in self.costs if k.split("(", 1)[0] == codec_id)
        where = ", ".join(self.files) or "no results"
        also = f" (measured: {', '.join(near)})" if near else ""
        return f"no quality result for {key} in {where}{also}"


def parse_results(data: object, source: str) -> QualityTable:
    """One result file's content (``source`` names it in errors and in each cost's source)."""
    if not isinstance(data, dict):
        raise ProfileError(f"quality results {source}: expected a JSON object, got {type(data).__name__}")
    cond = data.get("conditions")
    if not isinstance(cond, dict) or not isinstance(cond.get("model"), str) or not cond["model"]:
        raise ProfileError(f"quality results {source}: no conditions.model (not a `kvport eval quality` result?)")
    codecs = data.get("codecs")
    if not isinstance(codecs, dict) or not codecs:
        raise ProfileError(f"quality results {source}: no codecs")
    how = _conditions_line(cond, data.get("provenance"))
    costs: dict[str, QualityCost] = {}
    for name, entry in codecs.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"]:
            raise ProfileError(f"quality results {source}: codecs.{name} has no key")
        deltas: dict[str, float] = {}
        for k, v in entry.items():
            if not k.startswith(_DELTA):
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ProfileError(f"quality results {source}: codecs.{name}.{k} is not a finite number: {v!r}")
            deltas[k[len(_DELTA):]] = float(v)
        if not deltas:
            raise ProfileError(f"quality results {source}: codecs.{name} has no {_DELTA}<set> figure")
        worst = max(deltas.values())
        sets = ", ".join(f"{s} {d:+.2f}%" for s, d in sorted(deltas.items()))
        costs[entry["key"]] = QualityCost(entry["key"], max(worst, 0.0) / 100.0, f"{source}: {sets}{how}")
    return QualityTable(cond["model"], costs, (source,))


def _conditions_line(cond: dict[str, Any], prov: object) -> str:
    parts = []
    if isinstance(cond.get("windows_per_set"), int) and isinstance(cond.get("tokens_per_window"), int):
        parts.append(f"{cond['windows_per_set']}x{cond['tokens_per_window']} tokens per set")
    if isinstance(cond.get("kv_dtype"), str):
        parts.append(f"{cond['kv_dtype']} KV")
    if isinstance(prov, dict) and isinstance(prov.get("date"), str):
        parts.append(prov["date"][:10])
    return f" ({', '.join(parts)})" if parts else ""


def merge(tables: Sequence[QualityTable]) -> QualityTable:
    """One table from several of the same model; a key in several takes the last table's cost."""
    if not tables:
        raise ProfileError("no quality results given")
    models = {t.model for t in tables}
    if len(models) > 1:
        raise ProfileError(f"quality results of different models: {', '.join(sorted(models))}")
    costs: dict[str, QualityCost] = {}
    for t in tables:
        costs.update(t.costs)
    return QualityTable(tables[0].model, costs, tuple(f for t in tables for f in t.files))


def load_results(paths: Sequence[str | Path]) -> QualityTable:
    """Result files written by ``kvport eval quality --json PATH``, merged in order."""
    tables = []
    for p in map(Path, paths):
        try:
            text = p.read_text()
        except OSError as exc:
            raise ProfileError(f"cannot read quality results {p}: {exc.strerror or exc}") from exc
        tables.append(_parse_text(text, str(p)))
    return merge(tables)


def default_results() -> QualityTable:
    """The measured defaults shipped with kvport (see the module docstring)."""
    ref = resources.files("kvport.planner").joinpath(DEFAULT_RESULTS)
    try:
        text = ref.read_text()
    except OSError as exc:
        raise ProfileError(f"kvport's quality defaults {DEFAULT_RESULTS} are missing: {exc}") from exc
    return _parse_text(text, f"kvport/planner/{DEFAULT_RESULTS}")


def _parse_text(text: str, source: str) -> QualityTable:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"quality results {source} are not JSON: {exc.msg} at line {exc.lineno}") from exc
    return parse_results(data, source)
