"""Shared fixtures: a real redis-server on a free 127.0.0.1 port, the reference model folder.

Tests of an optional part are skipped, naming the extra to install, where that extra's packages are
not installed (the core-only environments of ``make wheelcheck``; tests/core_tests.txt lists the
tests those run): a test module whose import, or a test whose run, fails for want of an optional
package (torch, numba, transformers, vllm, ...) is reported as skipped, never as an error. Where the
package is installed (``make test``'s own venv) nothing changes: a real ImportError still fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from kvport.extras import missing_extra_for


def _needs_extra(exc: BaseException | None, user: str) -> str | None:
    """The skip reason when ``exc`` (or what caused it) is the absence of an optional package."""
    while exc is not None:
        if isinstance(exc, ImportError):
            err = missing_extra_for(exc, user)
            if err is not None:
                return str(err)
        exc = exc.__cause__ or exc.__context__
    return None


class _OptionalModule(pytest.Module):
    """A test module that is skipped, not an error, when it imports an optional package that is missing."""

    def _getobj(self) -> object:
        try:
            return super()._getobj()
        except self.CollectError as exc:
            reason = _needs_extra(exc.__cause__, self.path.name)
            if reason is None:
                raise
            pytest.skip(reason, allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if module_path.name == "__init__.py":
        return None
    return _OptionalModule.from_parent(parent, path=module_path)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                           pytest.TestReport]:
    report = yield
    if report.failed and call.excinfo is not None:
        reason = _needs_extra(call.excinfo.value, "this test")
        if reason is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")
    return report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A real redis-server child process, persistence off, stopped by its pid."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server not installed (make test installs it)")
        self.exe = exe
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisCluster:
    """A real Redis Cluster: ``primaries`` x (1 + ``replicas``) ``redis-server --cluster-enabled yes``
    children on 127.0.0.1, joined by ``redis-cli --cluster create``, persistence off."""

    def __init__(self, workdir: Path, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            pytest.skip("redis-server / redis-cli not installed (make test installs them)")
        self.exe, self.cli, self.workdir = exe, cli, workdir
        self.ports = [_cluster_port() for _ in range(primaries * (1 + replicas))]
        self.replicas, self.node_timeout_ms = replicas, node_timeout_ms
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start_node(self, port: int) -> None:
        d = self.workdir / str(port)
        d.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [self.exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(d), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.cmd(port, "PING") != "PONG":
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster node {port} did not start")
            time.sleep(0.05)

    def cmd(self, port: int, *args: str) -> str:
        out = subprocess.run([self.cli, "-p", str(port), *args], capture_output=True, text=True, timeout=10,
                             check=False)
        return out.stdout.strip()

    def start(self) -> RedisCluster:
        for p in self.ports:
            self.start_node(p)
        subprocess.run([self.cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       capture_output=True, timeout=60, check=True)
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node reports ``cluster_state:ok`` and sees every slot served, and every
        replica's link to its primary is up (a replica that never synced cannot take over)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [self.cmd(p, "CLUSTER", "INFO") for p in self.procs]
            repl = [self.cmd(p, "INFO", "replication") for p in self.procs]
            synced = all("role:master" in r or "master_link_status:up" in r for r in repl)
            if synced and all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos):
                return
            time.sleep(0.2)
        raise RuntimeError("the Redis Cluster did not become ok")

    def primary_of(self, key: bytes) -> int:
        """The port of the primary serving ``key``'s slot."""
        live = next(iter(self.procs))  # a node still running
        slot = int(self.cmd(live, "CLUSTER", "KEYSLOT", key.decode()))
        for line in self.cmd(live, "CLUSTER", "NODES").splitlines():
            f = line.split()
            if "master" in f[2] and "fail" not in f[2]:
                for rng in f[8:]:
                    lo, _, hi = rng.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return int(f[1].split(":")[1].split("@")[0])
        raise RuntimeError(f"no primary serves slot {slot}")

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)


@pytest.fixture()
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    c = RedisCluster(tmp_path / "cluster")
    c.workdir.mkdir()
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The converted reference model (``make test`` prepares it; converted here if missing)."""
    from kvport.config import Settings
    from kvport.refmodel import is_prepared, prepare

    d = Settings.from_env().model_dir
    if not is_prepared(d):
        prepare(d)
    return d
