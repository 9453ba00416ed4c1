"""``kvport bench trace [--trace PATH] [--capacity SIZE] [--set traces=all]``: replay Mooncake traces
through the store's placement and eviction objects and compare the hit rate with the offline optimum.

Traces (:data:`TRACES`, the FAST'25 release of kvcache-ai/Mooncake, Apache-2.0): ``conversation``
(the default) and ``synthetic``. Each is found by :func:`find_trace`: ``--trace PATH`` (conversation
only), else the file (or its ``.xz``) in ``$KVPORT_TRACE_DIR``, else in a source checkout's own
``traces/`` (both shipped there xz-compressed, with their licence note; not in the wheel), else in
``../shared/traces`` beside the checkout.

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
``results.hit_rate`` is the default policy (:data:`kvport.store.eviction.DEFAULT_POLICY`);
every policy is reported beside it (``results.<policy>_hit_rate`` / ``_vs_optimal`` / ``_evictions``).

Fairness of the comparison: the trace's ids are chained (an id always has the same parent), so a
block's next use is never before its parent's and Belady evicts children before parents: its prefix
hits are plain hits and it is the optimum (MIN with bypass: the blocks a request just brought in are
candidates too). The online policies have the same option: new blocks are leaves and may be evicted
at the end of the request that brought them.

``--set sweep=true`` adds ``results.sweep``: each policy's hit rate / optimum at 5%, 10% and 20% of
the distinct blocks, on the whole trace and on each half (each half's own distinct blocks).

``--set traces=all`` replays both traces instead (``--capacity`` does not apply) and reports, per
trace and per capacity (5/10/20% of that trace's distinct blocks), every policy against Belady and
the int8 capacity lever, then the summary over the six cells::

    results.traces.<trace>.capacities.<5%|10%|20%>  (a cell)
                                               capacity_blocks, optimal_hit_rate,
                                               <policy>_hit_rate, <policy>_vs_optimal,
                                               default_minus_lru = (default - lru) / optimal,
                                               int8_capacity_blocks, int8_hit_rate, int8_vs_optimal
    results.mean_gain_over_lru                 mean of default_minus_lru over the cells
    results.worst_cell_vs_lru                  its smallest value (results.worst_cell names the cell)
    results.int8_same_bytes_10pct_vs_optimal   conversation, 10%: the default policy holding int8
                                               blocks in the bytes of the uncompressed 10% /
                                               Belady at 10% of the blocks uncompressed
    results.int8                               blocks_per_raw_block (stored raw block bytes / int8
                                               frame bytes, for the Llama-3.1-8B spec at 512 tokens)
                                               and the int8 perplexity cost, read from a measured
                                               ``kvport eval quality`` result (``--set quality=PATH``,
                                               else the one shipped with kvport); null when unknown
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.config import Settings
from kvport.errors import KVPortError, UserInputError
from kvport.evidence.timing import ratio
from kvport.sim.trace import read_trace
from kvport.spec import from_preset
from kvport.store.eviction import DEFAULT_POLICY, POLICIES, make_policy
from kvport.store.index import TierIndex
from kvport.units import parse_size

TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACES = {"conversation": TRACE_NAME, "synthetic": "mooncake_synthetic_trace.jsonl"}
TRACE_BLOCK_TOKENS = 512
FRACTIONS = (0.05, 0.10, 0.20)


def checkout_traces() -> list[Path]:
    """Where a source checkout (src layout) keeps traces: its own ``traces/`` (shipped, xz), then
    ``../shared/traces`` beside it; empty when kvport is not run from a checkout."""
    root = Path(__file__).resolve().parents[3]  # <checkout>/src/kvport/bench/trace.py
    return [root / "traces", root.parent / "shared" / "traces"] if (root / "pyproject.toml").is_file() else []


def _in(folder: Path, name: str) -> Path | None:
    for path in (folder / name, folder / f"{name}.xz"):
        if path.is_file():
            return path
    return None


def find_trace(given: str | Path | None = None, settings: Settings | None = None, name: str = TRACE_NAME) -> Path:
    """The trace file ``name`` (or ``name.xz``): ``given`` (``--trace``), else in ``settings.trace_dir``
    (``$KVPORT_TRACE_DIR``), else in the first of :func:`checkout_traces` that holds it. The first option
    set is the one used (a ``--trace`` or a trace folder that lacks the file is an error, not a
    fall-through)."""
    if given is not None and str(given):
        return Path(given)
    s = settings if settings is not None else Settings.from_env()
    if s.trace_dir is not None:
        path = _in(s.trace_dir, name)
        if path is None:
            raise UserInputError(f"KVPORT_TRACE_DIR={s.trace_dir} holds no {name}: pass --trace PATH")
        return path
    folders = checkout_traces()
    for folder in folders:
        path = _in(folder, name)
        if path is not None:
            return path
    where = f"not in {' or '.join(map(str, folders))}" if folders else "no checkout's traces/ to look in"
    raise UserInputError(f"no trace: pass --trace PATH or set KVPORT_TRACE_DIR ({name} {where})")


def default_trace(settings: Settings | None = None, name: str = TRACE_NAME) -> Path | None:
    """:func:`find_trace` without ``--trace``, or None where it finds no trace."""
    try:
        return find_trace(None, settings, name)
    except UserInputError:
        return None


def load_trace(path: Path, limit: int | None = None) -> list[list[int]]:
    """Full-block id lists, one per request, in arrival order (a ``.xz`` file is read decompressed): the
    simulator's strict reader (:func:`kvport.sim.trace.read_trace`), whose errors name the line and field."""
    return [list(r.full_blocks(TRACE_BLOCK_TOKENS)) for r in read_trace(path, limit=limit)]


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


def sweep(reqs: Sequence[Sequence[int]], fractions: Sequence[float] = FRACTIONS) -> dict[str, Any]:
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


def int8_blocks_per_raw_block() -> float | None:
    """How many int8 blocks fit in the bytes of one raw block as the store holds them (envelope
    included), for the Llama-3.1-8B spec at the trace's 512-token blocks; None without the codecs."""
    try:
        from kvport.codec import get_codec
        from kvport.codec.block_frame import max_frame_size
        from kvport.codec.envelope import stored_bytes

        spec = from_preset("llama-3.1-8b").with_(block_size=TRACE_BLOCK_TOKENS)
        return stored_bytes(spec) / max_frame_size(get_codec("int8"), spec)
    except (ImportError, KVPortError):
        return None


def int8_quality(path: str | None) -> dict[str, Any]:
    """int8's perplexity cost (worst text set, %) from a ``kvport eval quality`` result: ``path``, else
    the measured file shipped with kvport. A named file that does not read is an error; without one,
    an unreadable default is reported as unknown (null), never guessed."""
    from kvport.planner.quality import default_results, load_results

    try:
        table = load_results([path]) if path else default_results()
    except KVPortError as exc:
        if path:
            raise UserInputError(f"--set quality={path}: {exc}") from exc
        return {"ppl_delta_pct": None, "model": None, "source": f"unknown: {exc}"}
    cost = table.lookup("int8", lossless=False)
    if cost is None:
        return {"ppl_delta_pct": None, "model": table.model, "source": table.why_missing("int8")}
    return {"ppl_delta_pct": round(cost.cost * 100, 4), "model": table.model, "source": cost.source}


def capacities(reqs: Sequence[Sequence[int]], int8_ratio: float | None) -> dict[str, Any]:
    """Every policy and the default policy with int8 blocks (same bytes) at each of :data:`FRACTIONS`."""
    distinct = len({h for r in reqs for h in r})
    out: dict[str, Any] = {}
    for f in FRACTIONS:
        cap = max(1, round(distinct * f))
        opt = belady(reqs, cap)
        row: dict[str, Any] = {"capacity_blocks": cap, "optimal_hit_rate": round(opt, 5)}
        rates = {name: replay(reqs, cap, name)["hit_rate"] for name in POLICIES}
        for name, h in rates.items():
            row[f"{name}_hit_rate"] = round(h, 5)
            row[f"{name}_vs_optimal"] = ratio(h, opt)
        row["default_minus_lru"] = round((rates[DEFAULT_POLICY] - rates["lru"]) / opt, 5) if opt else None
        if int8_ratio is not None:
            cap8 = int(cap * int8_ratio)
            h8 = replay(reqs, cap8, DEFAULT_POLICY)["hit_rate"]
            row.update(int8_capacity_blocks=cap8, int8_hit_rate=round(h8, 5), int8_vs_optimal=ratio(h8, opt))
        else:
            row.update(int8_capacity_blocks=None, int8_hit_rate=None, int8_vs_optimal=None)
        out[f"{round(f * 100)}%"] = row
    return out


def run_all(opts: SuiteOptions, limit: int | None) -> Report:
    """``--set traces=all``: both traces, every policy at 5/10/20%, the int8 lever, the summary."""
    t0 = time.perf_counter()
    int8_ratio = int8_blocks_per_raw_block()
    per_trace: dict[str, Any] = {}
    cond_traces: dict[str, Any] = {}
    for name, file in TRACES.items():
        path = find_trace(None, None, file)
        reqs = load_trace(path, limit)
        cond_traces[name] = {"trace": str(path), "requests": len(reqs), "block_refs": sum(len(r) for r in reqs),
                             "distinct_blocks": len({h for r in reqs for h in r})}
        per_trace[name] = {"capacities": capacities(reqs, int8_ratio)}
    gains = {f"{name} {cell}": row["default_minus_lru"] for name, t in per_trace.items()
             for cell, row in t["capacities"].items() if row["default_minus_lru"] is not None}
    worst = min(gains, key=gains.__getitem__) if gains else None
    ten = per_trace["conversation"]["capacities"]["10%"]
    quality = opts.extra.get("quality")
    results: dict[str, Any] = {
        "policy": DEFAULT_POLICY,
        "mean_gain_over_lru": round(sum(gains.values()) / len(gains), 5) if gains else None,
        "worst_cell_vs_lru": gains[worst] if worst is not None else None,
        "worst_cell": worst,
        "int8_same_bytes_10pct_vs_optimal": ten["int8_vs_optimal"],
        "int8": {"blocks_per_raw_block": round(int8_ratio, 4) if int8_ratio is not None else None,
                 **int8_quality(str(quality) if quality else None)},
        "traces": per_trace,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    cond = conditions(traces=cond_traces, block_tokens=TRACE_BLOCK_TOKENS, fractions=list(FRACTIONS),
                      int8_spec="llama-3.1-8b bf16, 512-token blocks")
    limits = {"optimal_hit_rate": {name: {cell: row["optimal_hit_rate"] for cell, row in t["capacities"].items()}
                                   for name, t in per_trace.items()}}
    return finish(Report("trace", cond, limits, results))


def run(opts: SuiteOptions) -> Report:
    which = str(opts.extra.get("traces", "conversation"))
    limit = opts.number("requests", 1500 if opts.quick else 0, integer=True) or None
    if which == "all":
        return run_all(opts, limit)
    if which not in TRACES:
        raise UserInputError(f"--set traces={which!r}: expected all or one of {', '.join(TRACES)}")
    given = opts.extra.get("trace") if which == "conversation" else None
    path = find_trace(str(given) if given else None, None, TRACES[which])
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
