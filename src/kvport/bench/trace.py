"""``kvport bench trace [--trace PATH] [--capacity SIZE]``: replay a Mooncake trace through the
store's placement and eviction objects and compare the hit rate with the offline optimum.

The trace: ``--trace PATH``, else ``mooncake_conversation_trace.jsonl`` in ``$KVPORT_TRACE_DIR``,
else in ``../shared/traces`` beside the source checkout (:func:`find_trace`).

Replay: each request's ``hash_ids`` are its chained block keys (512 tokens a block). Only full
blocks are keyed (``input_length // 512`` of them), as :func:`kvport.keys.chain_keys` does. For
each request: ``hits`` = the longest prefix present (a block counts only with its whole prefix,
as :meth:`TieredStore.lookup` counts it); the hits are touched last-block-first, the missing
blocks inserted under their parent, and leaves evicted in policy order down to the capacity. This
is exactly :class:`~kvport.store.index.TierIndex` with unit sizes: the store's own objects, with no
bytes moved.

Optimum: Belady (evict the block whose next use is farthest away) over the same full-block stream
and the same prefix-hit counting. Capacity: ``10%`` of the distinct blocks by default; also
accepts a block count (``5000``) or a size (``20GiB``, converted with the Llama-3.1-8B bf16 spec).
``results.hit_rate`` is the default policy (``slru``, :data:`kvport.store.eviction.DEFAULT_POLICY`);
every policy is reported beside it (``results.<policy>_hit_rate`` / ``_vs_optimal`` / ``_evictions``).

Fairness of the comparison: the trace's ids are chained (an id always has the same parent), so a
block's next use is never before its parent's and Belady evicts children before parents: its prefix
hits are plain hits and it is the optimum (MIN with bypass: the blocks a request just brought in are
candidates too). The online policies have the same option: new blocks are leaves and may be evicted
at the end of the request that brought them (``slru`` ranks a never-hit block below the blocks hit
in the last ``probation`` x (blocks held) ticks).

``--set sweep=true`` adds ``results.sweep``: each policy's hit rate / optimum at 5%, 10% and 20% of
the distinct blocks, on the whole trace and on each half (each half's own distinct blocks), to check
that a policy's gain is not an artefact of one capacity or one stretch of the trace (slower: ~1 min).
"""

from __future__ import annotations

import heapq
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.config import Settings
from kvport.errors import UserInputError
from kvport.evidence.timing import ratio
from kvport.spec import from_preset
from kvport.store.eviction import DEFAULT_POLICY, POLICIES, make_policy
from kvport.store.index import TierIndex
from kvport.units import parse_size

TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512


def checkout_traces() -> Path | None:
    """``<checkout>/../shared/traces`` when kvport runs from a source checkout (src layout), else None."""
    root = Path(__file__).resolve().parents[3]  # <checkout>/src/kvport/bench/trace.py
    return root.parent / "shared" / "traces" if (root / "pyproject.toml").is_file() else None


def find_trace(given: str | Path | None = None, settings: Settings | None = None) -> Path:
    """The trace to replay: ``given`` (``--trace``), else :data:`TRACE_NAME` in ``settings.trace_dir``
    (``$KVPORT_TRACE_DIR``), else in :func:`checkout_traces`. The first option set is the one used (a
    ``--trace`` or a trace folder that lacks the file is an error, not a fall-through)."""
    if given is not None and str(given):
        return Path(given)
    s = settings if settings is not None else Settings.from_env()
    if s.trace_dir is not None:
        path = s.trace_dir / TRACE_NAME
        if not path.is_file():
            raise UserInputError(f"KVPORT_TRACE_DIR={s.trace_dir} holds no {TRACE_NAME}: pass --trace PATH")
        return path
    folder = checkout_traces()
    if folder is None or not (folder / TRACE_NAME).is_file():
        where = f"not in {folder}" if folder is not None else "no checkout's ../shared/traces to look in"
        raise UserInputError(f"no trace: pass --trace PATH or set KVPORT_TRACE_DIR ({TRACE_NAME} {where})")
    return folder / TRACE_NAME


def default_trace(settings: Settings | None = None) -> Path | None:
    """:func:`find_trace` without ``--trace``, or None where it finds no trace."""
    try:
        return find_trace(None, settings)
    except UserInputError:
        return None


def load_trace(path: Path, limit: int | None = None) -> list[list[int]]:
    """Full-block id lists, one per request, in arrival order."""
    out: list[list[int]] = []
    try:
        with open(path) as f:
            for line in f:
                if limit is not None and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                row = json.loads(line)
                full = int(row["input_length"]) // TRACE_BLOCK_TOKENS
                out.append([int(h) for h in row["hash_ids"][:full]])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserInputError(f"cannot read trace {path}: {exc}") from exc
    return out


def capacity_blocks(text: object, distinct: int) -> int:
    s = str(text).strip()
    if s.endswith("%"):
        return max(1, round(distinct * float(s[:-1]) / 100))
    if s.isdigit():
        return int(s)
    per_block = from_preset("llama-3.1-8b").request_bytes(TRACE_BLOCK_TOKENS)
    return max(1, parse_size(s) // per_block)


def _key(h: int) -> bytes:
    return h.to_bytes(16, "little")


def replay(reqs: Sequence[Sequence[int]], capacity: int, policy: str = DEFAULT_POLICY) -> dict[str, float]:
    """Hit rate of ``policy`` through a :class:`TierIndex` of ``capacity`` unit-size blocks."""
    ix = TierIndex(make_policy(policy), capacity)
    hits = refs = evictions = 0
    for r in reqs:
        keys = [_key(h) for h in r]
        n = 0
        for k in keys:
            if k not in ix:
                break
            n += 1
        hits += n
        refs += len(keys)
        for k in reversed(keys[:n]):
            ix.touch(k)
        parent = keys[n - 1] if n else None
        for k in keys[n:]:
            ix.add(k, 1, parent)
            parent = k
        if ix.used > capacity:
            for v in ix.victims():
                ix.remove(v, evicted=True)
                evictions += 1
                if ix.used <= capacity:
                    break
    return {"hit_rate": hits / refs if refs else 0.0, "evictions": evictions}


def belady(reqs: Sequence[Sequence[int]], capacity: int) -> float:
    """Prefix-hit rate of the offline optimum: evict the block whose next use is farthest away."""
    seq = [h for r in reqs for h in r]
    inf = len(seq) + 1
    nxt = [0] * len(seq)
    last: dict[int, int] = {}
    for p in range(len(seq) - 1, -1, -1):
        nxt[p] = last.get(seq[p], inf)
        last[seq[p]] = p
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = p = 0
    for r in reqs:
        for h in r:
            if h not in cache:
                break
            hits += 1
        for h in r:
            cache[h] = nxt[p]
            heapq.heappush(heap, (-nxt[p], h))
            p += 1
        while len(cache) > capacity:
            neg, h = heapq.heappop(heap)
            if cache.get(h) == -neg:
                del cache[h]
    return hits / len(seq) if seq else 0.0


def sweep(reqs: Sequence[Sequence[int]], fractions: Sequence[float] = (0.05, 0.10, 0.20)) -> dict[str, Any]:
    """``{part: {"5%": {"optimal_hit_rate": x, "<policy>_vs_optimal": y, ...}}}`` for the whole trace and
    each half, capacity a fraction of that part's distinct blocks."""
    half = len(reqs) // 2
    out: dict[str, Any] = {}
    for part, rs in (("all", reqs), ("first_half", reqs[:half]), ("second_half", reqs[half:])):
        distinct = len({h for r in rs for h in r})
        rows: dict[str, Any] = {}
        for f in fractions:
            cap = max(1, round(distinct * f))
            opt = belady(rs, cap)
            row: dict[str, Any] = {"capacity_blocks": cap, "optimal_hit_rate": round(opt, 5)}
            for name in POLICIES:
                h = replay(rs, cap, name)["hit_rate"]
                row[f"{name}_hit_rate"] = round(h, 5)
                row[f"{name}_vs_optimal"] = ratio(h, opt)
            rows[f"{round(f * 100)}%"] = row
        out[part] = rows
    return out


def run(opts: SuiteOptions) -> Report:
    given = opts.extra.get("trace")
    path = find_trace(str(given) if given else None)
    limit = opts.number("requests", 1500 if opts.quick else 0, integer=True) or None
    reqs = load_trace(path, limit)
    distinct = len({h for r in reqs for h in r})
    cap = capacity_blocks(opts.extra.get("capacity", "10%"), distinct)
    cond = conditions(trace=str(path), requests=len(reqs), block_refs=sum(len(r) for r in reqs),
                      distinct_blocks=distinct, capacity_blocks=cap, block_tokens=TRACE_BLOCK_TOKENS,
                      capacity_fraction=round(cap / distinct, 4) if distinct else None)
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    per_policy = {name: replay(reqs, cap, name) for name in POLICIES}
    replay_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt = belady(reqs, cap)
    belady_s = time.perf_counter() - t0
    results["policy"] = DEFAULT_POLICY
    results["hit_rate"] = round(per_policy[DEFAULT_POLICY]["hit_rate"], 5)
    results["optimal_hit_rate"] = round(opt, 5)
    results["hit_rate_vs_optimal"] = ratio(per_policy[DEFAULT_POLICY]["hit_rate"], opt)
    for name, r in per_policy.items():
        results[f"{name}_hit_rate"] = round(r["hit_rate"], 5)
        results[f"{name}_vs_optimal"] = ratio(r["hit_rate"], opt)
        results[f"{name}_evictions"] = r["evictions"]
    results["replay_seconds_all_policies"] = round(replay_s, 3)
    results["belady_seconds"] = round(belady_s, 3)
    if str(opts.extra.get("sweep", "")).lower() in ("1", "true", "yes"):
        results["sweep"] = sweep(reqs)
    return finish(Report("trace", cond, {"optimal_hit_rate": round(opt, 5)}, results))
