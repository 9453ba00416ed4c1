"""The demo's shared KV tier: a ``kvport serve`` child process (host + disk tiers) on 127.0.0.1.

Started with a free port; the port is read from the server's first stdout line
(``{"event": "listening", "port": ...}``); stopped by its pid with SIGTERM (graceful drain).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvport.client.conn import ClientConfig
from kvport.client.remote import RemoteTier
from kvport.config import subprocess_env
from kvport.errors import ServerError, TierUnavailableError


class SharedTier:
    def __init__(self, disk_dir: Path, capacity: str = "768MiB") -> None:
        self.disk_dir = disk_dir
        self.capacity = capacity
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def start(self, timeout_s: float = 60.0) -> int:
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "kvport.cli.main", "serve", "--listen", "127.0.0.1:0", "--capacity",
               self.capacity, "--disk", str(self.disk_dir), "--inflight", "64MiB", "--max-value", "16MiB"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=subprocess_env({"KVPORT_LOG_LEVEL": "ERROR"}))
        line = self.proc.stdout.readline() if self.proc.stdout is not None else ""
        try:
            info = json.loads(line)
            self.port = int(info["port"])
        except (ValueError, KeyError, TypeError) as exc:
            err = self.proc.stderr.read() if self.proc.stderr and self.proc.poll() is not None else ""
            self.stop()
            raise ServerError(f"shared tier did not start: {line.strip() or err.strip()[-400:]}") from exc
        return self.port

    def client(self, name: str = "shared") -> RemoteTier:
        if not self.port:
            raise TierUnavailableError("shared tier not started")
        return RemoteTier(ClientConfig(port=self.port, timeout_s=30.0), name=name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None
