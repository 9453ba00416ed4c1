"""A real ``kvport serve`` child process per test (or per module), stopped by its pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvport.client.conn import ClientConfig
from kvport.client.remote import RemoteTier

MiB = 1 << 20


class ServerProc:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> ServerProc:
        env = dict(os.environ, **(self.env or {}))
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 - a file, not a pipe: a chatty server never blocks
        self.proc = subprocess.Popen([sys.executable, "-m", "kvport.cli.serve_cmd", *self.args],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.wait(10)
            self.err.seek(0)
            raise RuntimeError(f"server did not start (rc={self.proc.returncode}): {self.err.read().decode()}")
        self.info = json.loads(line)
        return self

    @property
    def port(self) -> int:
        return int(self.info["port"])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, tenant: str = "default", token: str | None = None, **kw: Any) -> RemoteTier:
        return RemoteTier(ClientConfig(port=self.port, tenant=tenant, token=token, **kw))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            rc = self.proc.wait(30)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.err.close()
        self.proc = None
        return rc


def base_args(capacity: str = "400MiB", *extra: str) -> list[str]:
    return ["--listen", "127.0.0.1:0", "--capacity", capacity, "--max-value", "32MiB", "--inflight", "64MiB",
            *extra]


@pytest.fixture
def server_factory() -> Iterator[Any]:
    started: list[ServerProc] = []

    def make(*args: str, env: dict[str, str] | None = None) -> ServerProc:
        s = ServerProc(list(args), env).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def shared_server() -> Iterator[ServerProc]:
    """One open (tenant ``default``, no token) loopback server for the tests that can share it."""
    s = ServerProc(base_args("400MiB", "--http-port", "0")).start()
    yield s
    s.stop()


TOKENS = {"alice": "alice-secret-token", "bob": "bob-secret-token", "small": "small-secret-token",
          "big": "big-secret-token"}


@pytest.fixture(scope="session")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """A server bound beyond loopback (0.0.0.0): every tenant has a token, ``small`` has a 4 MiB quota."""
    f = write_tenants(tmp_path_factory.mktemp("tenants") / "tenants.json", [
        {"name": "alice", "token": TOKENS["alice"], "admin": True},
        {"name": "bob", "token": TOKENS["bob"]},
        {"name": "small", "token": TOKENS["small"], "quota": "4MiB"},
        {"name": "big", "token": TOKENS["big"]}])
    s = ServerProc(["--listen", "0.0.0.0:0", "--capacity", "384MiB", "--max-value", "32MiB", "--inflight", "64MiB",
                    "--tenants", str(f)]).start()
    yield s
    s.stop()


def write_tenants(path: Path, tenants: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def make_cert(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl): (cert, key)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=kvport", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key
