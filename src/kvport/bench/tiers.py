"""``kvport bench tiers``: put/get of one request's KV through each tier, next to the raw path.

Payload: a 2048-token request (128 tokens with ``--quick``) of Llama-3.1-8B-shaped bf16 KV (256 MiB)
and of the SmolLM2-135M shape, cut into canonical blocks (``spec.bytes_per_block``) as the store
holds them. Limits measured in the same run on the same bytes:

* host tier  vs numpy memcpy (``np.copyto``) of the whole request into a reused buffer;
* disk tier  vs raw write (the faster of one ``write`` and 4 MiB ``write``s) / cold ``readinto`` of
  one file of the same bytes (posix_fadvise DONTNEED before every cold read, in the same folder);
* redis tier vs raw redis-py pipelined SET/GET of the same block values, the faster of one pipeline
  for all and pipelines of ~8 MiB (the tier pipelines a batched get in such groups; one huge
  pipeline was ~25% slower here, so it alone would flatter the tier), against a redis-server the
  suite starts on a free port (persistence off) or ``KVPORT_REDIS_URL``.

Each trial runs the limit and the tier back to back (interleaved), so a noisy neighbour slows both;
medians over trials are reported.
Extra options (``--set``): ``tokens=N``, ``dir=PATH`` (disk folder), ``trials=N``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.config import Settings
from kvport.errors import KVPortError
from kvport.evidence.limits import raw_redis_gbps
from kvport.evidence.pagecache import drop_file_cache
from kvport.evidence.timing import gbps, ratio
from kvport.spec import KVSpec, from_preset
from kvport.tiers import DiskTier, HostTier, RedisTier, Tier

_RAW_PIECE = 4 << 20


def _median(ts: list[float]) -> float:
    ts = sorted(ts)
    return ts[len(ts) // 2]


@contextlib.contextmanager
def redis_url() -> Iterator[str | None]:
    """KVPORT_REDIS_URL, or a private redis-server on a free port (persistence off), or None."""
    url = Settings.from_env().redis_url
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="kvport-redis-") as d:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        break
                except OSError:
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


def _blocks(spec: KVSpec, tokens: int) -> tuple[np.ndarray, list[memoryview], list[bytes]]:
    total = spec.request_bytes(tokens)
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, total, dtype=np.uint8)
    bb = spec.bytes_per_block
    views = [payload.data[i : i + bb] for i in range(0, total, bb)]
    keys = [i.to_bytes(16, "little") for i in range(len(views))]
    return payload, views, keys


def _put_get_round(tier: Tier, items: list[tuple[bytes, memoryview]], gets: list[tuple[bytes, memoryview]],
                   keys: list[bytes]) -> tuple[float, float]:
    """One timed put_many and get_many_into of the whole request, then the blocks are deleted again."""
    t0 = time.perf_counter()
    tier.put_many(items)
    t1 = time.perf_counter()
    got = tier.get_many_into(gets)
    t2 = time.perf_counter()
    if None in got:
        raise KVPortError(f"{tier.name} tier lost a block during the benchmark")
    for k in keys:
        tier.delete(k)
    return t1 - t0, t2 - t1


def _host(views: list[memoryview], keys: list[bytes], src: np.ndarray, dst: np.ndarray,
          trials: int) -> dict[str, float]:
    """Host tier put/get, each trial interleaved with the memcpy limit so both see the same load."""
    bb = views[0].nbytes
    tier = HostTier(bb * (len(views) + 1), bb)
    out = dst.data
    items = list(zip(keys, views, strict=True))
    gets = [(k, out[i * bb : (i + 1) * bb]) for i, k in enumerate(keys)]
    mt: list[float] = []
    pt: list[float] = []
    gt: list[float] = []
    for _ in range(trials + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        mt.append(time.perf_counter() - t0)
        put_s, get_s = _put_get_round(tier, items, gets, keys)
        pt.append(put_s)
        gt.append(get_s)
    tier.close()
    n = src.nbytes
    return {"memcpy_gbps": gbps(n, _median(mt[1:])), "put_gbps": gbps(n, _median(pt[1:])),
            "get_gbps": gbps(n, _median(gt[1:]))}


def _disk(folder: Path, views: list[memoryview], keys: list[bytes], src: np.ndarray, dst: np.ndarray,
          trials: int) -> dict[str, float]:
    """Disk tier write / cold read, each trial interleaved with raw write / cold readinto of one file
    (which of the two goes first alternates from trial to trial: the page cache's writeback of the
    previous round's files weighs on whatever runs next)."""
    n = src.nbytes
    bb = views[0].nbytes
    tier = DiskTier(folder / "tier", 4 * n)
    raw = folder / "raw.bin"
    out = dst.data
    items = list(zip(keys, views, strict=True))
    gets = [(k, out[i * bb : (i + 1) * bb]) for i, k in enumerate(keys)]
    times: dict[str, list[float]] = {"raw_w": [], "raw_w4": [], "raw_r": [], "w": [], "r": []}

    def raw_round() -> None:
        raw.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(raw, "wb", buffering=0) as f:
            f.write(src.data)
        times["raw_w"].append(time.perf_counter() - t0)
        raw.unlink()
        t0 = time.perf_counter()
        with open(raw, "wb", buffering=0) as f:  # the same bytes in 4 MiB writes
            for off in range(0, n, _RAW_PIECE):
                f.write(src.data[off : off + _RAW_PIECE])
        times["raw_w4"].append(time.perf_counter() - t0)
        drop_file_cache(raw)
        t0 = time.perf_counter()
        with open(raw, "rb", buffering=0) as f:
            f.readinto(out)
        times["raw_r"].append(time.perf_counter() - t0)
        raw.unlink()

    def tier_round() -> None:
        for k in keys:
            tier.delete(k)
        t0 = time.perf_counter()
        tier.put_many(items)
        times["w"].append(time.perf_counter() - t0)
        for path in {tier.path_of(k) for k in keys}:
            drop_file_cache(path)
        t0 = time.perf_counter()
        got = tier.get_many_into(gets)
        times["r"].append(time.perf_counter() - t0)
        if None in got:
            raise KVPortError("disk tier lost a block during the benchmark")

    for trial in range(trials):  # the order alternates: each side follows the other as often
        for step in ((raw_round, tier_round) if trial % 2 == 0 else (tier_round, raw_round)):
            step()
    for k in keys:
        tier.delete(k)
    # the faster of one big write and 4 MiB writes is the raw limit (the stricter comparison)
    raw_w = min(_median(times["raw_w"]), _median(times["raw_w4"]))
    return {"raw_write_gbps": gbps(n, raw_w), "raw_read_gbps": gbps(n, _median(times["raw_r"])),
            "write_gbps": gbps(n, _median(times["w"])), "read_gbps": gbps(n, _median(times["r"]))}


def _redis(url: str, views: list[memoryview], keys: list[bytes], dst: np.ndarray,
           trials: int) -> dict[str, float | None]:
    """Redis tier put_many/get_many_into, each trial next to raw pipelined SET/GET of the same values."""
    n = sum(v.nbytes for v in views)
    bb = views[0].nbytes
    tier = RedisTier(url, prefix="kvport-bench:")
    out = dst.data
    items = list(zip(keys, views, strict=True))
    gets = [(k, out[i * bb : (i + 1) * bb]) for i, k in enumerate(keys)]
    pt: list[float] = []
    gt: list[float] = []
    sets: list[float] = []
    raw_gets: list[float] = []
    one_get: list[float] = []
    for _ in range(trials):
        raw = raw_redis_gbps(url, views, trials=1)
        if raw["set_gbps"] is None or raw["get_gbps"] is None:
            return {"raw_set_gbps": None, "raw_get_gbps": None, "put_gbps": None, "get_gbps": None}
        sets.append(raw["set_gbps"])
        raw_gets.append(raw["get_gbps"])
        one_get.append(raw.get("get_one_pipeline_gbps") or 0.0)
        put_s, get_s = _put_get_round(tier, items, gets, keys)
        pt.append(put_s)
        gt.append(get_s)
    tier.close()
    return {"raw_set_gbps": _median(sets), "raw_get_gbps": _median(raw_gets),
            "raw_get_one_pipeline_gbps": _median(one_get),
            "put_gbps": gbps(n, _median(pt)), "get_gbps": gbps(n, _median(gt))}


def _one_shape(label: str, spec: KVSpec, tokens: int, trials: int, folder: Path, url: str | None,
               limits: dict[str, Any], results: dict[str, Any]) -> None:
    payload, views, keys = _blocks(spec, tokens)
    n = payload.nbytes
    dst = np.zeros(n, dtype=np.uint8)
    dst.fill(1)  # pre-fault
    p = f"{label}_"
    limits[p + "bytes"] = n
    host = _host(views, keys, payload, dst, trials)
    ok = bool(np.array_equal(dst, payload))
    dst.fill(0)
    disk = _disk(folder, views, keys, payload, dst, trials)
    ok = ok and bool(np.array_equal(dst, payload))
    limits[p + "memcpy_gbps"] = host["memcpy_gbps"]
    limits[p + "raw_disk_write_gbps"] = disk["raw_write_gbps"]
    limits[p + "raw_disk_read_gbps"] = disk["raw_read_gbps"]
    results[p + "host_put_gbps"] = host["put_gbps"]
    results[p + "host_get_gbps"] = host["get_gbps"]
    results[p + "disk_write_gbps"] = disk["write_gbps"]
    results[p + "disk_read_gbps"] = disk["read_gbps"]
    results[p + "host_put_vs_memcpy"] = ratio(host["put_gbps"], host["memcpy_gbps"])
    results[p + "host_get_vs_memcpy"] = ratio(host["get_gbps"], host["memcpy_gbps"])
    results[p + "disk_write_vs_raw"] = ratio(disk["write_gbps"], disk["raw_write_gbps"])
    results[p + "disk_read_vs_raw"] = ratio(disk["read_gbps"], disk["raw_read_gbps"])
    red: dict[str, float | None] = {"raw_set_gbps": None, "raw_get_gbps": None, "put_gbps": None, "get_gbps": None}
    if url is not None:
        try:
            dst.fill(0)
            red = _redis(url, views, keys, dst, trials)
            ok = ok and (red["get_gbps"] is None or bool(np.array_equal(dst, payload)))
        except KVPortError:
            pass
    limits[p + "raw_redis_set_gbps"] = red["raw_set_gbps"]
    limits[p + "raw_redis_get_gbps"] = red["raw_get_gbps"]
    limits[p + "raw_redis_get_one_pipeline_gbps"] = red.get("raw_get_one_pipeline_gbps")
    results[p + "redis_put_gbps"] = red["put_gbps"]
    results[p + "redis_get_gbps"] = red["get_gbps"]
    results[p + "redis_put_vs_raw"] = ratio(red["put_gbps"], red["raw_set_gbps"])
    results[p + "redis_get_vs_raw"] = ratio(red["get_gbps"], red["raw_get_gbps"])
    results[p + "bytes_round_trip_exact"] = ok


def run(opts: SuiteOptions) -> Report:
    tokens = opts.number("tokens", 128 if opts.quick else 2048, lo=1, integer=True)
    trials = opts.number("trials", 2 if opts.quick else 5, lo=1, integer=True)
    base = opts.extra.get("dir")
    limits: dict[str, Any] = {}
    results: dict[str, Any] = {}
    shapes = {"llama": from_preset("llama-3.1-8b"), "smollm2": from_preset("smollm2-135m")}
    cond = conditions(tokens=tokens, trials=trials, threads=1,
                      models={k: s.model_id for k, s in shapes.items()},
                      block_bytes={k: s.bytes_per_block for k, s in shapes.items()})
    with tempfile.TemporaryDirectory(prefix="kvport-bench-tiers-", dir=base) as d, redis_url() as url:
        cond["redis"] = url
        for label, spec in shapes.items():
            _one_shape(label, spec, tokens, trials, Path(d), url, limits, results)
    # the headline fields name the Llama-shaped request
    for f in ("host_put_vs_memcpy", "host_get_vs_memcpy", "disk_write_vs_raw", "disk_read_vs_raw",
              "redis_put_vs_raw", "redis_get_vs_raw"):
        results[f] = results[f"llama_{f}"]
    return finish(Report("tiers", cond, limits, results))
