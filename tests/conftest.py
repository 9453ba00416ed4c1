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

from kvport.deploy.redis_cluster import RedisClusterProcs
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


@pytest.fixture()
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterProcs]:
    """A real Redis Cluster (3 primaries + 3 replicas, :mod:`kvport.deploy.redis_cluster`), ended after the test."""
    from kvport.errors import ConfigError

    try:
        c = RedisClusterProcs(tmp_path / "cluster")
    except ConfigError as exc:
        pytest.skip(f"{exc}")
    with c:
        yield c


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The converted reference model (``make test`` prepares it; converted here if missing)."""
    from kvport.config import Settings
    from kvport.refmodel import is_prepared, prepare

    d = Settings.from_env().model_dir
    if not is_prepared(d):
        prepare(d)
    return d
