"""``kvport bench soak``: ownership under faults -- a server and client processes for N minutes,
clients SIGKILLed at random and restarted, the server restarted once; nothing may leak or be lost --
then the server's memory under read hits and a lease flood (:mod:`kvport.bench.soak_memory`).
``--set phases=ownership,memory`` (the default) runs both, in that order, each on its own server;
``--set phases=memory`` only the memory phases (``hits``: GETs, 1,000,000, ``--quick`` 20,000;
``hold_s``: the flood's records held, 10 s, ``--quick`` 2).

The ownership phase::

    kvport serve (host + disk) <---- writer, reader, pinner, sender -> receiver (client processes,
                                      :mod:`kvport.bench.soak_client`); every ~``kill_every_s`` one of
                                      them is SIGKILLed (holding leases, pins, transfers in flight)
                                      and started again; half way the server is stopped (SIGTERM:
                                      drain, spill to disk) and started again on the same folder
    end: clients SIGKILLed, wait for the longest TTL + one reaper tick, then ask the server

Fields (``results``; the ownership phase's):

* ``leaked_pins`` / ``leaked_leases``: pins and leases still held past their TTL (``inspect --leaks``)
* ``blocks_without_owner``: blocks stored without a ledger record, plus ledger records without bytes
* ``orphan_children``: blocks kept without their parent
* ``lost_committed``: an acknowledged block missing while its reader held a live lease or pin on it,
  a value with wrong bytes anywhere, a committed transfer with bytes that are not the sender's, and
  a PREFIX block on disk before the server restart that is missing after it
* ``engine_blocks_owned_at_end``: blocks the live transfer engines still own after their last
  transfer (each frees what it handed off or received)
* ``peak_memory_vs_capacity``: the server's peak RSS (sampled every 50 ms) over ``--capacity``
* ``ops_per_second``: acknowledged client operations per second, all clients
* ``restart``: the server's own account of its restart (its log): host blocks spilled to disk at
  SIGTERM and those that found no room, blocks recovered from disk, blocks dropped at the start
  because their parent was gone

``results.memory``: the memory phases' (their module's docstring).

``limits.raw_socket_gbps`` (a loopback socket measured in the same run) is recorded for context:
the soak is about correctness under faults, not speed.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.bench.soak_memory import run_memory
from kvport.bench.soak_server import SoakServer
from kvport.client import ClientConfig, RemoteTier
from kvport.config import subprocess_env
from kvport.errors import ConfigError, KVPortError
from kvport.evidence.limits import raw_socket_gbps
from kvport.evidence.timing import ratio
from kvport.lifetime import Lifetime

MiB = 1 << 20
ROLES = ("writer", "reader", "pinner", "sender", "receiver")
HOLD_TTL_S = 8.0  # soak_client.MAX_TTL_S: every lease and pin lapses within this
PHASES = ("ownership", "memory")


@dataclass(slots=True)
class _ClientProc:
    role: str
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    stats_files: list[Path] = field(default_factory=list)


def _spawn(c: _ClientProc, port: int, folder: Path, seed: int) -> None:
    c.incarnation += 1
    stats = folder / f"{c.role}-{c.incarnation}.json"
    c.stats_files.append(stats)
    c.proc = subprocess.Popen(
        [sys.executable, "-m", "kvport.bench.soak_client", c.role, "--port", str(port), "--stats", str(stats),
         "--seed", str(seed), "--incarnation", str(c.incarnation), "--link", str(folder / "link.port"),
         "--epoch", str(folder / "epoch")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=subprocess_env({"KVPORT_LOG_LEVEL": "ERROR"}))


def _restart_log(path: Path) -> dict[str, int | None]:
    """What the server's log says of its restart: host blocks spilled to disk at SIGTERM (and those
    that stayed for want of room), blocks recovered from disk, blocks dropped because their parent
    was gone."""
    out: dict[str, int | None] = {"spilled": None, "not_spilled": None, "recovered": None, "dropped_parent_gone": None}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    spills = re.findall(r"spilled (\d+) host blocks to disk \((\d+) stayed", text)
    recs = re.findall(r"recovered (\d+) blocks from disk \((\d+) dropped", text)
    if spills:
        out["spilled"], out["not_spilled"] = int(spills[0][0]), int(spills[0][1])
    if len(recs) > 1:  # the first is the start on an empty folder
        out["recovered"], out["dropped_parent_gone"] = int(recs[1][0]), int(recs[1][1])
    return out


def _read(path: Path) -> dict[str, Any]:
    try:
        out: dict[str, Any] = json.loads(path.read_text())
        return out
    except (OSError, ValueError):
        return {}


def _disk_prefix_blocks(pool: RemoteTier) -> list[bytes]:
    """PREFIX blocks the server holds on disk now (they must survive a restart)."""
    keys = list(pool.keys())
    out: list[bytes] = []
    for i in range(0, len(keys), 1024):
        rows = pool.owners(keys[i : i + 1024]).blocks if len(keys[i : i + 1024]) > 1 else \
            pool.owners(keys[i : i + 1024]).blocks[-1:]
        out += [bytes.fromhex(r.key) for r in rows if r.tiers == ("disk",) and r.lifetime is Lifetime.PREFIX]
    return out


def _phases(opts: SuiteOptions) -> tuple[str, ...]:
    raw = str(opts.extra.get("phases", ",".join(PHASES)))
    asked = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not asked or any(p not in PHASES for p in asked):
        raise ConfigError(f"--set phases={raw!r}: expected a comma-separated list of {', '.join(PHASES)}")
    return tuple(p for p in PHASES if p in asked)


def _serve_args(folder: Path, capacity: int, disk_capacity: int) -> list[str]:
    return ["--listen", "127.0.0.1:0", "--capacity", str(capacity), "--disk", str(folder / "disk"),
            "--disk-capacity", str(disk_capacity), "--max-value", "8MiB", "--inflight", "64MiB"]


def run(opts: SuiteOptions) -> Report:
    phases = _phases(opts)
    minutes = opts.number("minutes", 1.0 if opts.quick else 10.0, lo=0.05)
    kill_every = opts.number("kill_every_s", 30.0, lo=1.0)
    capacity = opts.number("capacity_bytes", 384 * MiB, lo=64 * MiB, integer=True)
    disk_capacity = opts.number("disk_capacity_bytes", 2048 * MiB, lo=64 * MiB, integer=True)
    seed = opts.number("seed", 1, integer=True)
    hits = opts.number("hits", 20_000 if opts.quick else 1_000_000, lo=1, integer=True)
    hold_s = opts.number("hold_s", 2.0 if opts.quick else 10.0, lo=0.0)
    cond = conditions(phases=list(phases), minutes=minutes, kill_every_s=kill_every, capacity_bytes=capacity,
                      disk_capacity_bytes=disk_capacity, clients=list(ROLES), hold_ttl_s=HOLD_TTL_S,
                      link="tcp 127.0.0.1", server="kvport serve (host + disk), io threads 4")
    if "memory" in phases:
        cond.update(memory_hits=hits, memory_hold_s=hold_s)
    limits = {"raw_socket_gbps": raw_socket_gbps(32 * MiB, trials=2)}
    results: dict[str, Any] = {}
    if "ownership" in phases:
        results.update(_ownership(cond, capacity, disk_capacity, minutes, kill_every, random.Random(seed)))
    if "memory" in phases:
        with tempfile.TemporaryDirectory(prefix="kvport-soak-memory-") as tmp:
            folder = Path(tmp)
            # --prefault: the pool resident from the start, so the idle RSS less the pool is the fixed overhead
            # the phases hold the server to (a growing pool would only make RSS lower)
            results["memory"] = run_memory([*_serve_args(folder, capacity, disk_capacity), "--prefault"],
                                           folder / "server.log",
                                           capacity, hits, hold_s)
    return finish(Report("soak", cond, limits, results))


def _ownership(cond: dict[str, Any], capacity: int, disk_capacity: int, minutes: float, kill_every: float,
               rng: random.Random) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvport-soak-") as tmp:
        folder = Path(tmp)
        (folder / "epoch").write_text("1")
        args = _serve_args(folder, capacity, disk_capacity)
        srv = SoakServer(args, folder / "server.log")
        port = srv.start()
        srv.args = [*args[:1], f"127.0.0.1:{port}", *args[2:]]  # a restart listens on the same port
        clients = [_ClientProc(r) for r in ROLES]
        for c in clients:
            _spawn(c, port, folder, rng.getrandbits(31))
        t0 = time.monotonic()
        end = t0 + minutes * 60.0
        restart_at = t0 + minutes * 30.0
        next_kill = t0 + rng.uniform(0.5, 1.5) * kill_every
        kills = restarts = 0
        lost_on_restart = 0
        server_exit = []
        while time.monotonic() < end:
            time.sleep(0.25)
            now = time.monotonic()
            if now >= next_kill:
                victim = rng.choice(clients)
                if victim.proc is not None:
                    victim.proc.kill()
                    victim.proc.wait(10)
                _spawn(victim, port, folder, rng.getrandbits(31))
                kills += 1
                next_kill = now + rng.uniform(0.5, 1.5) * kill_every
            if restarts == 0 and now >= restart_at:
                for c in clients:  # no writes while the disk snapshot is taken
                    if c.proc is not None:
                        c.proc.send_signal(signal.SIGSTOP)
                pool = RemoteTier(ClientConfig(port=port, client="soak-check", retries=1), name="pool")
                try:
                    on_disk = _disk_prefix_blocks(pool)
                finally:
                    pool.close()
                (folder / "epoch").write_text(str(2))
                server_exit.append(srv.stop(signal.SIGTERM))
                srv.start()
                pool = RemoteTier(ClientConfig(port=port, client="soak-check", retries=3), name="pool")
                try:
                    lost_on_restart = sum(1 for p in pool.contains_many(on_disk) if not p) if on_disk else 0
                finally:
                    pool.close()
                for c in clients:
                    if c.proc is not None:
                        c.proc.send_signal(signal.SIGCONT)
                restarts = 1
                cond["blocks_on_disk_at_restart"] = len(on_disk)
        elapsed = time.monotonic() - t0
        live_engines = [c for c in clients if c.role in ("sender", "receiver")]
        for c in live_engines:  # the engines stop cleanly and report what they still own
            if c.proc is not None:
                c.proc.send_signal(signal.SIGTERM)
        for c in live_engines:
            if c.proc is not None:
                c.proc.wait(30)
        engine_owned = sum(int(_read(c.stats_files[-1]).get("engine_owned", 0)) for c in live_engines)
        for c in clients:  # the rest die holding whatever they held
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait(10)
        time.sleep(HOLD_TTL_S + 2.5)  # every lease and pin past its TTL, plus a reaper tick
        pool = RemoteTier(ClientConfig(port=port, client="soak-check"), name="pool")
        try:
            leaks = pool.leaks()
            stats = pool.stats()
        except KVPortError:
            leaks, stats = None, None
        finally:
            pool.close()
        server_exit.append(srv.stop(signal.SIGTERM))
        restart_log = _restart_log(folder / "server.log")
        totals: dict[str, int] = {}
        for c in clients:
            for f in c.stats_files:
                for k, v in _read(f).items():
                    if isinstance(v, int):
                        totals[k] = totals.get(k, 0) + v
    results: dict[str, Any] = {
        "leaked_pins": None if leaks is None else len(leaks.expired_pins),
        "leaked_leases": None if leaks is None else len(leaks.expired_leases),
        "blocks_without_owner": None if leaks is None else len(leaks.without_owner) + len(leaks.unstored_records),
        "orphan_children": None if leaks is None else len(leaks.orphan_children),
        "lost_committed": totals.get("lost", 0) + totals.get("corrupt", 0) + lost_on_restart,
        "lost_on_server_restart": lost_on_restart,
        "lost_under_hold_or_corrupt": totals.get("lost", 0) + totals.get("corrupt", 0),
        "engine_blocks_owned_at_end": engine_owned,
        "peak_memory_vs_capacity": ratio(srv.peak_rss, capacity),
        "server_peak_rss_bytes": srv.peak_rss,
        "ops_per_second": round(totals.get("ops", 0) / elapsed, 1) if elapsed else None,
        "ops": totals.get("ops", 0),
        "transfers_committed": totals.get("transfers", 0),
        "blocks_handed_off": totals.get("handed_off", 0),
        "blocks_acquired": totals.get("acquired", 0),
        "client_errors_retried": totals.get("errors", 0),
        "clients_killed": kills,
        "server_restarts": restarts,
        "server_exit_codes": server_exit,
        "blocks_at_end": None if stats is None else sum(t.blocks for t in (stats.server.tiers if stats.server else ())),
        "elapsed_s": round(elapsed, 1),
        "restart": restart_log,
    }
    return results
