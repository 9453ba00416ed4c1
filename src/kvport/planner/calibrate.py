"""Measure this machine into a :class:`Profile`: prefill of a model, install, links, tiers, codecs.

Every number is measured here, in this process, as the median of ``trials`` runs:

- prefill: full prefills at ``lengths`` and incremental prefills of ``new`` tokens after ``context``
  cached tokens (through a ``DynamicCache`` built from block bytes, as a load would build it), fitted
  by :func:`kvport.planner.fit.fit_prefill`; torch runs with the threads the engine uses
  (``torch.get_num_threads()`` unless told otherwise);
- install: block bytes -> ``DynamicCache`` (bytes per second);
- links: kvport's TCP transport to a peer process on loopback (:class:`LoopbackPeer`), optionally
  throttled by a token bucket; latency from one-byte round trips, bandwidth after the latency;
- tiers: ``host`` (numpy copy between reused buffers) and ``disk`` (cold ``readinto`` after
  ``posix_fadvise(DONTNEED)``);
- codecs: encode/decode speed and size ratio of every registered codec but ``raw`` (the plain load)
  on real KV of the model, at default params; quality costs are read, not measured here: from
  ``kvport eval quality`` results (:mod:`kvport.planner.quality`; kvport's measured defaults unless
  the caller passes its own), 0 for lossless codecs, and a codec without one is left out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvport.errors import KVPortError, PlanInputError, ProfileError
from kvport.evidence.pagecache import drop_file_cache
from kvport.planner import hfkv
from kvport.planner.fit import fit_prefill
from kvport.planner.profile import CodecCost, Link, LinkKind, PrefillModel, PrefillPoint, Profile, machine_id
from kvport.planner.quality import QualityTable, default_results
from kvport.planner.throttle import LoopbackPeer
from kvport.spec import KVSpec

log = logging.getLogger("kvport.planner.calibrate")


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    lengths: tuple[int, ...] = (64, 192, 384, 768, 1536)
    incremental: tuple[tuple[int, int], ...] = ((512, 64), (1024, 64), (1024, 256))  # (context, new)
    trials: int = 2
    best_of: bool = False  # keep the fastest trial instead of the median (a box shared with other jobs)

    def __post_init__(self) -> None:
        if len(self.lengths) + len(self.incremental) < 3 or self.trials < 1:
            raise PlanInputError("a prefill plan needs >= 3 measurements and >= 1 trial")

    def summarize(self, runs: Sequence[float]) -> float:
        return min(runs) if self.best_of else statistics.median(runs)

    @property
    def max_tokens(self) -> int:
        return max([*self.lengths, *(c + n for c, n in self.incremental)])


def _median(fn: Callable[[], float], trials: int) -> float:
    return statistics.median(fn() for _ in range(trials))


def measure_prefill(model: Any, ids: torch.Tensor, spec: KVSpec, plan: PrefillPlan) -> list[PrefillPoint]:
    """Points (start, end, seconds) for ``plan``; ``ids`` is [1, >= plan.max_tokens] token ids.

    Trials run round-robin over the points (every point once, then again), so a burst of load from
    other processes lands on different points in different trials instead of spoiling one point."""
    if ids.shape[1] < plan.max_tokens:
        raise PlanInputError(f"calibration needs {plan.max_tokens} tokens, got {ids.shape[1]}")
    hfkv.forward(model, ids, 0, 32)  # warm up kernels and allocator
    buf = np.empty(0, dtype=np.uint8)
    if plan.incremental:
        ctx_max = max(c for c, _ in plan.incremental)
        ctx_max -= ctx_max % spec.block_size
        out, _ = hfkv.forward(model, ids, 0, ctx_max)
        buf = np.empty(spec.request_bytes(ctx_max), dtype=np.uint8)
        hfkv.cache_to_blocks(out.past_key_values, spec, 0, ctx_max, buf)

    def full(n: int) -> float:
        return hfkv.forward(model, ids, 0, n)[1]

    def incremental(c: int, new: int) -> float:
        cache = hfkv.blocks_to_cache(buf, spec, c // spec.block_size, model.config)
        return hfkv.forward(model, ids, c, c + new, cache)[1]

    jobs: list[tuple[int, int, Callable[[], float]]] = [(0, n, partial(full, n)) for n in plan.lengths]
    for ctx, new in plan.incremental:
        c = ctx - ctx % spec.block_size
        jobs.append((c, c + new, partial(incremental, c, new)))
    runs: list[list[float]] = [[] for _ in jobs]
    for _ in range(plan.trials):
        for i, (_, _, fn) in enumerate(jobs):
            runs[i].append(fn())
    return [PrefillPoint(s, e, plan.summarize(r)) for (s, e, _), r in zip(jobs, runs, strict=True)]


def measure_install(model: Any, ids: torch.Tensor, spec: KVSpec, tokens: int, trials: int = 3) -> float:
    """Bytes per second from block bytes to a ready DynamicCache."""
    tokens -= tokens % spec.block_size
    if tokens <= 0:
        raise PlanInputError("install measurement needs at least one block")
    out, _ = hfkv.forward(model, ids, 0, tokens)
    buf = np.empty(spec.request_bytes(tokens), dtype=np.uint8)
    hfkv.cache_to_blocks(out.past_key_values, spec, 0, tokens, buf)

    def run() -> float:
        t0 = time.perf_counter()
        hfkv.blocks_to_cache(buf, spec, tokens // spec.block_size, model.config)
        return time.perf_counter() - t0

    return buf.nbytes / _median(run, trials)


def prefill_model(model: Any, ids: torch.Tensor, spec: KVSpec, plan: PrefillPlan) -> PrefillModel:
    pts = measure_prefill(model, ids, spec, plan)
    return fit_prefill(pts, model_id=spec.model_id, threads=torch.get_num_threads(), measured_at=time.time())


def measure_link(peer: LoopbackPeer, name: str, rate: float = 0.0, probe_bytes: int = 16 << 20,
                 scratch: np.ndarray | None = None, trials: int = 2) -> Link:
    """Latency (median of 20 one-byte round trips) and bandwidth of ``probe_bytes`` sent at ``rate``."""
    n = min(probe_bytes, peer.capacity)
    buf = scratch if scratch is not None and scratch.nbytes >= n else np.empty(n, dtype=np.uint8)
    view = memoryview(buf.data).cast("B")[:n]
    lat = statistics.median(peer.ping() for _ in range(20))
    secs = _median(lambda: peer.get_into(0, view, rate), trials)
    bw = n / max(secs - lat, 1e-9)
    return Link(name, LinkKind.PEER, bw, lat, time.time(), source=f"calibrated ({n} bytes)")


def measure_host_tier(nbytes: int = 64 << 20, trials: int = 5) -> Link:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    secs = _median(lambda: _timed(lambda: np.copyto(dst, src)), trials)
    return Link("host", LinkKind.TIER, nbytes / secs, 0.0, time.time())


def measure_disk_tier(folder: Path, nbytes: int = 64 << 20, trials: int = 3) -> Link:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "kvport-calibrate-disk.bin"
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    try:
        with open(path, "wb", buffering=0) as f:
            f.write(src.data)
            os.fsync(f.fileno())

        def cold_read() -> float:
            drop_file_cache(path)
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                f.readinto(dst.data)
            return time.perf_counter() - t0

        secs = _median(cold_read, trials)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return Link("disk", LinkKind.TIER, nbytes / secs, 0.0, time.time())


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def profiled_codecs() -> tuple[str, ...]:
    """Codecs a profile measures: every registered one at default params but ``raw`` (the plain load)."""
    from kvport.codec import codec_ids

    return tuple(n for n in codec_ids() if n != "raw")


def codecs_left_out(quality: QualityTable, names: Sequence[str] | None = None) -> dict[str, str]:
    """Codec name -> why it stays out of the profile: no quality result of its key in ``quality``."""
    from kvport.codec import codec_ids, codec_key, get_codec

    out: dict[str, str] = {}
    for name in profiled_codecs() if names is None else names:
        if name not in codec_ids():
            out[name] = f"unknown codec {name!r}"
            continue
        codec = get_codec(name)
        if quality.lookup(codec_key(codec), codec.lossless) is None:
            out[name] = quality.why_missing(codec_key(codec))
    return out


def measure_codecs(k: torch.Tensor, v: torch.Tensor, quality: QualityTable, names: Sequence[str] | None = None,
                   trials: int = 3) -> tuple[CodecCost, ...]:
    """Speeds of each codec on ``k``/``v`` ((layers, heads, tokens, dim) CPU tensors) with its quality
    cost from ``quality``; unknown codecs and codecs without a quality result are left out."""
    from kvport.codec import KVShape, codec_ids, codec_key, get_codec

    out: list[CodecCost] = []
    shape = KVShape(int(k.shape[0]), int(k.shape[1]), int(k.shape[2]), int(k.shape[3]), _dtype_of(k))
    raw = shape.nbytes
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # codecs run on one thread (copy path)
    try:
        for name in profiled_codecs() if names is None else names:
            if name not in codec_ids():
                continue
            codec = get_codec(name)
            q = quality.lookup(codec_key(codec), codec.lossless)
            if q is None:
                log.info("calibrate: codec %s left out: %s", name, quality.why_missing(codec_key(codec)))
                continue
            try:
                t_enc, t_dec, size = _codec_times(codec, shape, k, v, k_out, v_out, trials)
            except KVPortError as exc:
                log.warning("calibrate: codec %s skipped: %s", name, exc)
                continue
            out.append(CodecCost(name, raw / size, raw / t_enc, raw / t_dec, q.cost, time.time(), q.source))
    finally:
        torch.set_num_threads(threads)
    return tuple(out)


def _codec_times(codec: Any, shape: Any, k: torch.Tensor, v: torch.Tensor, k_out: torch.Tensor,
                 v_out: torch.Tensor, trials: int) -> tuple[float, float, int]:
    buf = np.empty(codec.max_encoded_size(shape), dtype=np.uint8)
    enc = codec.encode(k, v, out=buf)
    t_enc = _median(lambda: _timed(lambda: codec.encode(k, v, out=buf)), trials)
    t_dec = _median(lambda: _timed(lambda: codec.decode(enc, k_out, v_out)), trials)
    return t_enc, t_dec, int(enc.nbytes)


def _dtype_of(t: torch.Tensor) -> Any:
    from kvport.spec import DType

    return {torch.float32: DType.FP32, torch.float16: DType.FP16, torch.bfloat16: DType.BF16}[t.dtype]


def reference_ids(tokenizer: Any, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids of real text (Python standard-library source, repeated if short): deterministic."""
    import argparse
    import inspect

    text = Path(inspect.getfile(argparse)).read_text()
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise PlanInputError("tokenizer produced no tokens")
    while len(ids) < tokens:
        ids = ids + ids
    return torch.tensor([ids[:tokens]], dtype=torch.long)


def calibrate(model: Any, ids: torch.Tensor, spec: KVSpec, *, plan: PrefillPlan | None = None,
              tier_folder: Path | None = None, link_probe_bytes: int = 32 << 20, tier_bytes: int = 64 << 20,
              codecs: bool = True, quality: QualityTable | None = None,
              progress: Callable[[str], None] = log.info) -> Profile:
    """A full profile of this machine for ``model`` (whose KV ``spec`` describes); codec quality
    costs from ``quality`` (default: kvport's measured defaults), which must be of ``spec``'s model."""
    plan = plan or PrefillPlan()
    table = (quality if quality is not None else default_results()) if codecs else None
    if table is not None and table.model != spec.model_id:  # checked before the long measurements
        raise ProfileError(f"quality results measured {table.model}, not the profiled {spec.model_id}")
    now = time.time()
    progress("prefill: " + ", ".join(map(str, plan.lengths)) + " tokens")
    pf = prefill_model(model, ids, spec, plan)
    progress("install")
    install = measure_install(model, ids, spec, min(512, max(plan.lengths)))
    progress("links: loopback TCP peer")
    links = [measure_host_tier(tier_bytes)]
    if tier_folder is not None:
        links.append(measure_disk_tier(tier_folder, tier_bytes))
    with LoopbackPeer(link_probe_bytes) as peer:
        links.append(measure_link(peer, "loopback", 0.0, link_probe_bytes))
    costs: tuple[CodecCost, ...] = ()
    if table is not None:
        progress("codecs")
        out, _ = hfkv.forward(model, ids, 0, 256)
        cache = out.past_key_values
        k = torch.stack([layer.keys[0] for layer in cache.layers]).contiguous()
        v = torch.stack([layer.values[0] for layer in cache.layers]).contiguous()
        costs = measure_codecs(k, v, table)
    return Profile(machine=machine_id(), created=now, prefill=pf, links=tuple(links), codecs=costs,
                   install_bps=install)
