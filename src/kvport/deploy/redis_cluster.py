"""A real Redis Cluster on this host, for the tests and ``kvport bench scaleout``: ``primaries`` x
(1 + ``replicas``) ``redis-server --cluster-enabled yes`` children on 127.0.0.1 (persistence off),
joined by ``redis-cli --cluster create``; and the faults a deployment meets, made on demand.

::

    c = RedisClusterProcs(folder).start()   # every slot served, every replica synced
    c.url                                   # redis://127.0.0.1:PORT/0 (any node: the client maps the rest)
    c.primary_of(b"kvport:{ab12}")          # the port of the primary serving that key's slot
    c.caught_up(port)                       # its replicas acknowledged all it wrote
    c.kill(port)                            # SIGKILL: the node is gone, its replica is promoted
    c.pause(port) / c.resume(port)          # SIGSTOP / SIGCONT: a node cut off (a partition), or a
                                            # replica left behind (it stops applying the stream)
    c.migrate(src, dst, slots)              # slots moved while serving (MOVED/ASK mid-batch)
    c.close()                               # every node this handle started is ended

Every handle ends what it started (also after a failure); nothing is ended by name. Debian's
``redis-server`` here; Valkey's ``valkey-server`` / ``valkey-cli`` take the same arguments.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from kvport.errors import ConfigError, PeerError


def cluster_port() -> int:
    """A free 127.0.0.1 port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randrange(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise PeerError("no free port pair for a Redis Cluster node")


class RedisClusterProcs:
    def __init__(self, folder: Path, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            raise ConfigError("redis-server / redis-cli not found (make installs them; apt-get install redis-server)")
        self.exe, self.cli, self.folder = exe, cli, folder
        self.ports = [cluster_port() for _ in range(primaries * (1 + replicas))]
        self.replicas, self.node_timeout_ms = replicas, node_timeout_ms
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.paused: set[int] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def __enter__(self) -> RedisClusterProcs:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ processes
    def start_node(self, port: int) -> None:
        d = self.folder / str(port)
        d.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [self.exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(d), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.cmd(port, "PING") != "PONG":
            if time.monotonic() > deadline:
                raise PeerError(f"Redis Cluster node {port} did not start")
            time.sleep(0.05)

    def start(self) -> RedisClusterProcs:
        try:
            for p in self.ports:
                self.start_node(p)
            out = subprocess.run([self.cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                                  "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                                 capture_output=True, text=True, timeout=60, check=False)
            if out.returncode != 0:
                raise PeerError(f"redis-cli --cluster create failed: {out.stdout[-500:]}{out.stderr[-500:]}")
            self.wait_ok()
        except BaseException:
            self.close()
            raise
        return self

    def cmd(self, port: int, *args: str, timeout_s: float = 10.0) -> str:
        """One ``redis-cli`` command against a node; its stdout ("" when the node does not answer)."""
        try:
            out = subprocess.run([self.cli, "-p", str(port), *args], capture_output=True, text=True,
                                 timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return ""
        return out.stdout.strip()

    def live(self) -> list[int]:
        """Nodes running and not paused."""
        return [p for p in self.procs if p not in self.paused]

    def wait_ok(self, timeout_s: float = 30.0) -> float:
        """Until every live node reports ``cluster_state:ok`` and every slot served, and every live
        replica's link to its primary is up (a replica that never synced cannot take over); the seconds
        it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            infos = [self.cmd(p, "CLUSTER", "INFO") for p in self.live()]
            repl = [self.cmd(p, "INFO", "replication") for p in self.live()]
            synced = all("role:master" in r or "master_link_status:up" in r for r in repl)
            if synced and all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise PeerError(f"the Redis Cluster did not become ok within {timeout_s:.0f} s")

    def caught_up(self, primary: int) -> bool:
        """Every replica of ``primary`` has acknowledged its whole replication stream (the offsets of its
        ``INFO replication``; replicas acknowledge every second): what it acknowledged survives its kill."""
        fields = dict(ln.split(":", 1) for ln in self.cmd(primary, "INFO", "replication").splitlines() if ":" in ln)
        if "master_repl_offset" not in fields:
            return False
        head = int(fields["master_repl_offset"])
        replicas = [dict(kv.split("=", 1) for kv in v.split(",")) for k, v in fields.items()
                    if k.startswith("slave") and k[5:].isdigit()]
        return bool(replicas) and all(int(r.get("offset", -1)) >= head for r in replicas)

    # ------------------------------------------------------------------ topology
    def nodes(self) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as seen by a live node: id, port, role, failed, primary id, slot ranges."""
        out: list[dict[str, Any]] = []
        for line in self.cmd(self.live()[0], "CLUSTER", "NODES").splitlines():
            f = line.split()
            if len(f) < 8:
                continue
            ranges = []
            for rng in f[8:]:
                lo, _, hi = rng.partition("-")
                if lo.isdigit():
                    ranges.append((int(lo), int(hi or lo)))
            out.append({"id": f[0], "port": int(f[1].split(":")[1].split("@")[0]),
                        "primary": "master" in f[2], "failed": "fail" in f[2] and "fail?" not in f[2],
                        "primary_id": None if f[3] == "-" else f[3], "slots": ranges})
        return out

    def slot_of(self, key: bytes) -> int:
        return int(self.cmd(self.live()[0], "CLUSTER", "KEYSLOT", key.decode()))

    def primary_of(self, key: bytes) -> int:
        """The port of the primary serving ``key``'s slot."""
        slot = self.slot_of(key)
        for n in self.nodes():
            if n["primary"] and not n["failed"] and any(lo <= slot <= hi for lo, hi in n["slots"]):
                return int(n["port"])
        raise PeerError(f"no primary serves slot {slot}")

    def replica_of(self, primary: int) -> int:
        nodes = self.nodes()
        pid = next(n["id"] for n in nodes if n["port"] == primary)
        return next(int(n["port"]) for n in nodes if n["primary_id"] == pid and n["port"] in self.procs)

    def primaries(self) -> list[int]:
        return [int(n["port"]) for n in self.nodes() if n["primary"] and not n["failed"] and n["slots"]]

    # ------------------------------------------------------------------ faults
    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        self.paused.discard(port)
        proc.kill()
        proc.wait(10)

    def pause(self, port: int) -> None:
        """SIGSTOP: the node answers nothing (to clients, its primary or the cluster bus) until resumed."""
        self.procs[port].send_signal(signal.SIGSTOP)
        self.paused.add(port)

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)
        self.paused.discard(port)

    def migrate(self, src: int, dst: int, slots: int, timeout_s: float = 120.0) -> subprocess.Popen[str]:
        """Start moving ``slots`` slots (and their keys) from primary ``src`` to primary ``dst`` with
        ``redis-cli --cluster reshard``, the operator's tool; returns the running process (the caller
        serves meanwhile, then waits for it)."""
        ids = {n["port"]: n["id"] for n in self.nodes()}
        return subprocess.Popen(
            [self.cli, "--cluster", "reshard", f"127.0.0.1:{src}", "--cluster-from", ids[src], "--cluster-to",
             ids[dst], "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "10",
             "--cluster-timeout", str(int(timeout_s * 1000))],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def close(self) -> None:
        for port in list(self.procs):
            if port in self.paused:
                with contextlib.suppress(OSError):
                    self.procs[port].send_signal(signal.SIGCONT)
            self.kill(port)


__all__ = ["RedisClusterProcs", "cluster_port"]
