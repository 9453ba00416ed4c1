"""Request traces for the simulator: Mooncake's JSONL format, read strictly.

One JSON object a line (the FAST'25 release of kvcache-ai/Mooncake, shipped in ``traces/``)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival in ms (non-decreasing), ``hash_ids`` the chained ids of the prompt's
blocks of ``block_tokens`` tokens (512 in Mooncake's traces; the last id may cover a partial block).
Two optional fields let a trace say what an open-loop trace cannot: ``after`` (the index of an
earlier request: this one arrives at its ``timestamp`` or ``delay_ms`` after that one's last token,
whichever is later, as a chat's next turn does) and ``session`` (a label). Any problem, a line that
is not JSON, a field missing or of the wrong type, a timestamp before its predecessor, is a
:class:`~kvport.errors.SimInputError` naming the line and the field: a simulator that guessed would
answer a question nobody asked.
"""

from __future__ import annotations

import json
import lzma
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvport.errors import SimInputError

MOONCAKE_BLOCK_TOKENS = 512
MAX_TOKENS = 1 << 24  # a prompt or answer longer than 16M tokens is a broken line, not a request
MAX_HASH_ID = (1 << 63) - 1
MAX_MS = 1e12  # ~32 years: a timestamp or delay beyond it is a broken line


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # open-loop arrival (ignored when ``after`` is set)
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # chained block ids (full blocks and maybe one partial)
    after: int | None = None  # index of the request whose last token gates this one
    delay_s: float = 0.0  # ... plus this long
    session: str = ""

    def full_blocks(self, block_tokens: int) -> tuple[int, ...]:
        """The ids of the prompt's full blocks: only they are reusable KV."""
        return self.hash_ids[: self.input_tokens // block_tokens]


def _int(row: dict[str, object], name: str, where: str, lo: int, hi: int = MAX_TOKENS) -> int:
    v = row.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SimInputError(f"{where}: field {name!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _number(row: dict[str, object], name: str, where: str) -> float:
    v = row.get(name)
    try:
        ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and 0 <= v <= MAX_MS
    except OverflowError:  # an integer too large for a float
        ok = False
    if not ok:
        raise SimInputError(f"{where}: field {name!r} must be a number in [0, {MAX_MS:g}] (ms), got {str(v)[:40]}")
    return float(v)  # type: ignore[arg-type]


def parse_line(line: str, where: str, index: int) -> TraceRequest:
    """One trace line (``where`` names it in errors; ``index`` is its position, for ``after``)."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise SimInputError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(row, dict):
        raise SimInputError(f"{where}: a line must be a JSON object, got {type(row).__name__}")
    ts = _number(row, "timestamp", where)
    n_in = _int(row, "input_length", where, 1)
    n_out = _int(row, "output_length", where, 1)
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= MAX_HASH_ID
                                            for h in ids):
        raise SimInputError(f"{where}: field 'hash_ids' must be a list of integers in [0, 2**63)")
    after = row.get("after")
    if after is not None:
        after = _int(row, "after", where, 0, max(0, index - 1)) if index > 0 else None
        if after is None:
            raise SimInputError(f"{where}: field 'after' names a request, but this is the first line")
    delay = _number(row, "delay_ms", where) / 1e3 if "delay_ms" in row else 0.0
    session = row.get("session", "")
    if not isinstance(session, str):
        raise SimInputError(f"{where}: field 'session' must be a string, got {session!r}")
    return TraceRequest(ts / 1e3, n_in, n_out, tuple(ids), after, delay, session)


def parse_lines(lines: Iterable[str], name: str = "trace", limit: int | None = None,
                scale: float = 1.0) -> list[TraceRequest]:
    """Requests of ``lines`` in order; arrivals multiplied by ``scale`` (0.5: twice the rate)."""
    if not math.isfinite(scale) or scale <= 0:
        raise SimInputError(f"scale must be a finite number > 0, got {scale!r}")
    out: list[TraceRequest] = []
    last = 0.0
    for no, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        r = parse_line(line, f"{name} line {no}", len(out))
        if r.arrival_s < last:
            raise SimInputError(f"{name} line {no}: field 'timestamp' {r.arrival_s * 1e3:g} ms is before the "
                                f"previous line's {last * 1e3:g} ms (a trace is in arrival order)")
        last = r.arrival_s
        out.append(r if scale == 1.0 else TraceRequest(r.arrival_s * scale, r.input_tokens, r.output_tokens,
                                                       r.hash_ids, r.after, r.delay_s, r.session))
    if not out:
        raise SimInputError(f"{name}: no requests")
    return out


def _open(path: Path) -> Iterator[str]:
    try:
        with (lzma.open(path, "rt") if path.suffix == ".xz" else open(path)) as f:
            yield from f
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as exc:
        raise SimInputError(f"cannot read trace {path}: {exc}") from exc


def read_trace(path: str | Path, *, limit: int | None = None, scale: float = 1.0) -> list[TraceRequest]:
    """A Mooncake-format trace file (plain or ``.xz``)."""
    p = Path(path)
    return parse_lines(_open(p), p.name, limit, scale)


def write_trace(path: str | Path, reqs: Iterable[TraceRequest]) -> None:
    """The inverse of :func:`read_trace` (timestamps in ms), for traces built from a measured run."""
    with open(path, "w") as f:
        for r in reqs:
            row: dict[str, object] = {"timestamp": round(r.arrival_s * 1e3, 3), "input_length": r.input_tokens,
                                      "output_length": r.output_tokens, "hash_ids": list(r.hash_ids)}
            if r.after is not None:
                row["after"] = r.after
                row["delay_ms"] = round(r.delay_s * 1e3, 3)
            if r.session:
                row["session"] = r.session
            f.write(json.dumps(row) + "\n")
