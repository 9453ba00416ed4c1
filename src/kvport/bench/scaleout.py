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
    nixl_vs_bare_nixl, nixl_tcp_vs_raw_socket, links
        null: kvport has no NIXL transport and no shaped links yet (issue 28, items 2 and 3)

``--set values=N size=BYTES trials=T slots=S`` (``--quick``: fewer and smaller).
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
from kvport.errors import KVPortError, TierError
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
    results: dict[str, Any] = {
        "nixl_vs_bare_nixl": None, "nixl_tcp_vs_raw_socket": None, "links": None,
        "reasons": {"nixl_vs_bare_nixl": _NOT_BUILT.format(what="NIXL transport", item=2),
                    "nixl_tcp_vs_raw_socket": _NOT_BUILT.format(what="NIXL transport", item=2),
                    "links": _NOT_BUILT.format(what="shaped links between namespaces", item=3)},
    }
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
    return finish(Report("scaleout", cond, limits, results))


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
