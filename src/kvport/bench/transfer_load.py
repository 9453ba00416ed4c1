"""Load scenarios on real sockets (threads of one process): layer-wise overlap and 3x overload.

Used by ``kvport bench transfer`` and the tests; each returns a JSON-ready dict.

Layer-wise overlap: a producer computes layers and sends each layer's KV over a rate-limited link,
one after the other or streamed (layer i on the wire while layer i+1 computes). The compute is a
:class:`LayerCompute`: the bench passes the reference model's real decoder-layer forward (torch
lives there, not here); :class:`SleepCompute` is the stand-in, and the report names which ran.

Overload: a producer offers ``3 x capacity`` bytes/s of 1 MiB requests; one consumer takes committed
requests at ``capacity`` bytes/s and then frees their buffers. The receiver's pool has ``budget``
bytes the credits are computed from, inside a physical cap of ``4 x budget`` (beyond it a block has
no buffer and is dropped). With backpressure the sender stays within the credits and the producer's
scheduler holds requests back (``try_admit`` -> ``Rejected``); without it the sender sends at the
offered rate: buffers grow past the budget, then blocks are dropped and their requests must be
recomputed. Every consumed block is checked against the pattern its producer wrote (corruption).
"""

from __future__ import annotations

import collections
import functools
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from kvport.errors import PeerError, TierFullError, TransferError
from kvport.protocol.transport import Transport
from kvport.spec import DType, KVSpec
from kvport.transfer.credits import Backpressure, Rejected
from kvport.transfer.meta import TransferMeta
from kvport.transfer.ratelimit import RateLimited, TokenBucket
from kvport.transfer.receiver import Incoming, Receiver
from kvport.transfer.sender import LayerStreamer, Sender
from kvport.transfer.tcp import TcpTransport, tune


def scenario_spec(num_layers: int = 4) -> KVSpec:
    """64 KiB per block-layer (8 KV heads x 128 dims x 16 tokens, bf16)."""
    return KVSpec("kvport/loadtest", num_layers=num_layers, num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                  block_size=16, revision="v1")


def tcp_pair(timeout_s: float | None = 30.0) -> tuple[TcpTransport, TcpTransport]:
    la = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(la.getsockname())
    s, _ = la.accept()
    la.close()
    for x in (c, s):
        tune(x)
    return TcpTransport(c, timeout_s, "tcp-a"), TcpTransport(s, timeout_s, "tcp-b")


def _keys(req: int, n: int) -> tuple[bytes, ...]:
    return tuple(req.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n))


# ---------------------------------------------------------------------- overload
class _PagePool:
    """Block pages in one preallocated buffer; ``cap`` pages in all; counts peak use."""

    def __init__(self, block_bytes: int, pages: int) -> None:
        self.block_bytes = block_bytes
        self.buf = np.zeros(pages * block_bytes, dtype=np.uint8)
        self.mv = self.buf.data
        self.free = list(range(pages))
        self.lock = threading.Lock()
        self.used = 0
        self.peak = 0

    def take(self) -> int:
        with self.lock:
            if not self.free:
                raise TierFullError("no free page")
            self.used += self.block_bytes
            self.peak = max(self.peak, self.used)
            return self.free.pop()

    def give(self, pages: list[int]) -> None:
        with self.lock:
            self.free.extend(pages)
            self.used -= self.block_bytes * len(pages)


class _PoolDest:
    def __init__(self, pool: _PagePool, meta: TransferMeta) -> None:
        self.pool, self.meta = pool, meta
        self.pages: dict[int, int] = {}
        self.lb = meta.spec.bytes_per_layer_block  # decoded size (== the chunk on raw links)

    def view(self, block: int, layer: int) -> memoryview:
        page = self.pages.get(block)
        if page is None:
            page = self.pages[block] = self.pool.take()
        off = page * self.pool.block_bytes + layer * self.lb
        return self.pool.mv[off : off + self.lb]

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        self.pool.give(list(self.pages.values()))
        self.pages.clear()


def overload(backpressure: bool, quick: bool = False, capacity_bps: float = 48e6, offered_factor: float = 3.0,
             duration_s: float | None = None) -> dict[str, Any]:
    spec = scenario_spec()
    blocks_per_req = 4
    req_bytes = blocks_per_req * spec.bytes_per_block  # 1 MiB
    budget = 8 * req_bytes
    duration = duration_s if duration_s is not None else (1.5 if quick else 5.0)
    pool = _PagePool(spec.bytes_per_block, 4 * budget // spec.bytes_per_block)
    bp = Backpressure(enabled=backpressure)
    a, b = tcp_pair()
    rx = Receiver(b, spec, lambda m: _PoolDest(pool, m), budget_bytes=budget, bp=bp, auto_release=False)
    rx.start()
    tx = Sender(a, bp=bp, credit_timeout_s=30.0)
    src = np.empty((blocks_per_req, spec.bytes_per_block), dtype=np.uint8)
    lb = spec.bytes_per_layer_block
    stop = threading.Event()
    stats = collections.Counter[str]()
    t0 = time.monotonic()
    t_end = t0 + duration

    def consume() -> None:
        per_req = req_bytes / capacity_bps
        next_t = time.monotonic()
        while not stop.is_set():
            w0 = time.monotonic()
            try:
                inc: Incoming = rx.next_transfer(timeout=0.1)
                inc.wait(timeout=10)
            except TransferError:
                continue  # aborted: counted by the sender; its pages already returned
            finally:
                waited = time.monotonic() - w0
                if w0 < t_end:
                    stats["consumer_idle_us"] += int(min(waited, t_end - w0) * 1e6)
            # fixed service rate: each request costs per_req of the consumer's time; a late wake-up
            # (scheduler noise) is not lost capacity, waiting for work (starvation) is
            if waited > 0.001:
                next_t = max(next_t, time.monotonic())
            next_t += per_req
            time.sleep(max(0.0, next_t - time.monotonic()))
            dest = inc.dest
            if not isinstance(dest, _PoolDest):
                raise TypeError("overload scenario destinations are _PoolDest")
            tag = int.from_bytes(inc.meta.block_keys[0][:8], "little") & 0xFF
            for page in dest.pages.values():
                blk = pool.buf[page * pool.block_bytes : (page + 1) * pool.block_bytes : 4096]
                if not (blk == tag).all():
                    stats["corrupted_blocks"] += 1
            if time.monotonic() <= t_end:
                stats["consumed_bytes"] += req_bytes
                stats["consumed_requests"] += 1
            dest.abort()  # pages back to the pool
            rx.release(inc.bytes_received)

    timeline: dict[str, list[float]] = {"t_s": [], "memory_bytes": [], "goodput_mbps": [], "lost_blocks": []}

    def sample(step_s: float = 0.1) -> None:
        """Memory held and goodput per ``step_s`` over the run (the report's curves over time)."""
        last_t, last_bytes = t0, 0
        while not stop.wait(step_s) and time.monotonic() <= t_end + step_s:
            now, done = time.monotonic(), stats["consumed_bytes"]
            timeline["t_s"].append(round(now - t0, 3))
            timeline["memory_bytes"].append(pool.used)
            timeline["goodput_mbps"].append(round((done - last_bytes) / (now - last_t) / 1e6, 2))
            timeline["lost_blocks"].append(stats["lost_blocks"])
            last_t, last_bytes = now, done

    cons = threading.Thread(target=consume, daemon=True)
    cons.start()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    offered_rate = offered_factor * capacity_bps / req_bytes  # requests/s
    backlog: collections.deque[int] = collections.deque()
    produced = 0
    waits = 0
    try:
        while time.monotonic() < t_end:
            due = int((time.monotonic() - t0) * offered_rate)
            while produced < due:  # the producer offers 3x: requests queue at the scheduler, not in buffers
                backlog.append(produced)
                produced += 1
            if not backlog:
                time.sleep(0.001)
                continue
            if backpressure:
                adm = tx.try_admit()
                if isinstance(adm, Rejected):
                    waits += 1
                    time.sleep(min(adm.retry_after_s or 0.01, 0.01))
                    continue
            req = backlog.popleft()
            src.fill(req & 0xFF)
            meta = TransferMeta(spec, f"req{req}", _keys(req, blocks_per_req))
            try:
                tx.send(meta, lambda layer: [src[i, layer * lb : (layer + 1) * lb].data
                                             for i in range(blocks_per_req)])
                stats["sent_requests"] += 1
            except (TransferError, TierFullError) as exc:
                if isinstance(exc, PeerError):
                    raise
                stats["lost_requests"] += 1
                stats["lost_blocks"] += blocks_per_req
    finally:
        elapsed = time.monotonic() - t0
        stop.set()
        cons.join(5)
        sampler.join(5)
        tx.close()
        rx.close()
    goodput = stats["consumed_bytes"] / duration
    return {
        "backpressure": backpressure,
        "duration_s": round(elapsed, 3),
        "capacity_mbps": capacity_bps / 1e6,
        "offered_mbps": round(offered_factor * capacity_bps / 1e6, 1),
        "budget_bytes": budget,
        "physical_cap_bytes": 4 * budget,
        "peak_memory_bytes": pool.peak,
        "peak_memory_vs_budget": round(pool.peak / budget, 4),
        "lost_blocks": stats["lost_blocks"],
        "lost_requests": stats["lost_requests"],
        "corrupted_blocks": stats["corrupted_blocks"],
        "goodput_mbps": round(goodput / 1e6, 2),
        "goodput_vs_capacity": round(goodput / capacity_bps, 4),
        "requests_offered": produced,
        "requests_sent": stats["sent_requests"],
        "requests_consumed": stats["consumed_requests"],
        "requests_held_back": len(backlog),
        "admission_rejections": waits,
        "consumer_idle_s": round(stats["consumer_idle_us"] / 1e6, 3),
        "timeline": timeline,
    }


# ---------------------------------------------------------------------- layer-wise overlap
class LayerCompute(Protocol):
    """The producer's work in :func:`layerwise_overlap`.

    ``run(on_layer)`` computes the layers in order and calls ``on_layer(i, blocks)`` as soon as layer
    ``i``'s KV is in ``blocks`` (one buffer per block: its layer-``i`` bytes in ``spec``'s layout,
    untouched until ``run`` returns); it returns the seconds each layer's compute took, ``on_layer``'s
    time excluded. ``description`` names the compute in the report: a model's real layer forward
    (``kvport.bench.transfer``) or :class:`SleepCompute`, the labelled stand-in."""

    spec: KVSpec
    n_blocks: int
    description: str

    def run(self, on_layer: Callable[[int, Sequence[memoryview]], None]) -> list[float]: ...


class SleepCompute:
    """The stand-in for compute: ``time.sleep(compute_s)`` per layer, over a fixed byte pattern."""

    def __init__(self, layers: int = 16, compute_s: float = 0.025, n_blocks: int = 16) -> None:
        self.spec = scenario_spec(layers)
        self.n_blocks = n_blocks  # 1 MiB per layer at 16 blocks
        self.compute_s = compute_s
        self.description = f"sleep {compute_s * 1e3:g} ms per layer (stand-in, no model)"
        self._src = np.ones((n_blocks, self.spec.bytes_per_block), dtype=np.uint8)

    def run(self, on_layer: Callable[[int, Sequence[memoryview]], None]) -> list[float]:
        lb = self.spec.bytes_per_layer_block
        times: list[float] = []
        for layer in range(self.spec.num_layers):
            t0 = time.perf_counter()
            time.sleep(self.compute_s)
            times.append(time.perf_counter() - t0)
            on_layer(layer, [self._src[i, layer * lb : (layer + 1) * lb].data for i in range(self.n_blocks)])
        return times


def _pair_limited(rate_bps: float) -> tuple[Transport, Transport]:
    a, b = tcp_pair()
    return RateLimited(a, TokenBucket(rate_bps, burst_bytes=64 << 10)), b


def pipeline_bound(compute_s: Sequence[float], transfer_s: float) -> float:
    """Least time to the last layer at the receiver when layer ``i`` computes in ``compute_s[i]`` and
    then crosses the link in ``transfer_s``, one layer at a time on each: ``max over k of
    (compute of layers 0..k) + (transfer of layers k..L-1)`` (a two-stage pipeline in fixed order)."""
    total, best = 0.0, 0.0
    for k, c in enumerate(compute_s):
        total += c
        best = max(best, total + (len(compute_s) - k) * transfer_s)
    return best


def layerwise_overlap(compute: LayerCompute | None = None, layer_transfer_s: float | None = None,
                      quick: bool = False) -> dict[str, Any]:
    """Time to the last layer at the receiver over a rate-limited loopback link, sequential (compute
    a layer, then send it) against streamed (send layer i while layer i+1 computes).

    ``compute``: what the producer runs per layer (default: :class:`SleepCompute`, 8 layers when
    ``quick`` else 16). The link moves one layer in ``layer_transfer_s``; ``None`` balances it against
    the compute: a warm-up run first, then the median layer compute (overlap matters most there).
    ``sum_s`` (compute plus transfer) and ``bound_s`` (:func:`pipeline_bound`) use the layer times the
    streamed run measured, so the bound holds for that run; a sender slowing the compute beside it
    shows in ``compute_total_s`` (streamed against sequential), not in ``streamed_vs_bound``."""
    compute = compute if compute is not None else SleepCompute(8 if quick else 16)
    spec, n_blocks = compute.spec, compute.n_blocks
    layers = spec.num_layers
    layer_bytes = n_blocks * spec.bytes_per_layer_block
    dst = np.zeros((n_blocks, spec.bytes_per_block), dtype=np.uint8)
    from kvport.transfer.destination import BlockTableDestination

    link = "fixed"
    if layer_transfer_s is None:
        layer_transfer_s = statistics.median(compute.run(lambda _i, _b: None))
        link = "balanced: one layer's transfer = the median layer compute of a warm-up run"
    out: dict[str, Any] = {"compute": compute.description, "layers": layers, "layer_bytes": layer_bytes,
                           "link_mbps": round(layer_bytes / layer_transfer_s / 1e6, 2), "link": link}
    measured: dict[str, list[float]] = {}
    for mode in ("sequential", "streamed"):
        a, b = _pair_limited(layer_bytes / layer_transfer_s)
        rx = Receiver(b, spec, lambda m: BlockTableDestination(dst, range(n_blocks), m),
                      budget_bytes=max(64 << 20, layers * layer_bytes))
        rx.start()
        tx = Sender(a)
        meta = TransferMeta(spec, mode, _keys(1, n_blocks))
        t0 = time.monotonic()
        h = tx.begin(meta)
        inc = rx.next_transfer(5)
        if mode == "sequential":
            measured[mode] = compute.run(functools.partial(tx.send_layer, h))
            tx.end(h)
        else:
            st = LayerStreamer(tx, h)
            measured[mode] = compute.run(st.push)
            st.finish()
        inc.wait_for_layer(layers - 1, timeout=60)
        out[f"{mode}_s"] = round(time.monotonic() - t0, 4)
        tx.close()
        rx.close()
    base = measured["streamed"]
    compute_total = sum(base)
    transfer_total = layers * layer_transfer_s
    bound = pipeline_bound(base, layer_transfer_s)
    out["compute_per_layer_s"] = round(statistics.median(base), 4)
    out["compute_total_s"] = {mode: round(sum(t), 4) for mode, t in measured.items()}
    out["transfer_per_layer_s"] = round(layer_transfer_s, 4)
    out["sum_s"] = round(compute_total + transfer_total, 4)
    out["bound_s"] = round(bound, 4)
    out["streamed_vs_bound"] = round(out["streamed_s"] / bound, 4)
    out["streamed_vs_sum"] = round(out["streamed_s"] / (compute_total + transfer_total), 4)
    return out
