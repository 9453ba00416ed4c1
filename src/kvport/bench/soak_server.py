"""The ``kvport serve`` child process of ``kvport bench soak``, and its resident memory sampled.

::

    SoakServer.start()   python -m kvport.cli.serve_cmd ARGS; waits for its "listening" line
       sampler thread    RSS every 50 ms: ``peak_rss`` (every start of this object, the whole run)
                         and ``window_peak`` (since the last ``mark()``: one phase)
    SoakServer.stop()    SIGTERM (drain, spill), SIGKILL after 60 s
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from kvport.config import subprocess_env
from kvport.errors import ServerError

SAMPLE_S = 0.05


class SoakServer:
    def __init__(self, args: list[str], log: Path) -> None:
        self.args = args
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.host_pool_bytes = 0  # the pre-faulted host pool, as the server announced it
        self.peak_rss = 0
        self.window_peak = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def start(self) -> int:
        env = subprocess_env({"KVPORT_LOG_LEVEL": "INFO"})  # the spill and recovery lines (soak's restart log)
        with self.log.open("a") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvport.cli.serve_cmd", *self.args],
                                         stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise ServerError(f"soak server did not start (rc={self.proc.wait(10)})")
        info = json.loads(line)
        self.port, self.host_pool_bytes = int(info["port"]), int(info["host_capacity"])
        self._stop.clear()
        self._sampler = threading.Thread(target=self._sample, args=(self.proc.pid,), daemon=True)
        self._sampler.start()
        return self.port

    def rss(self) -> int:
        """The server's resident memory now (0 when it is not running)."""
        try:
            return 0 if self.proc is None else int(psutil.Process(self.proc.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def mark(self) -> None:
        """A new window starts: ``window_peak`` from now on."""
        self.window_peak = self.rss()

    def _sample(self, pid: int) -> None:
        try:
            p = psutil.Process(pid)
            while not self._stop.wait(SAMPLE_S):
                rss = int(p.memory_info().rss)
                self.peak_rss = max(self.peak_rss, rss)
                self.window_peak = max(self.window_peak, rss)
        except psutil.Error:
            return

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(2)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None
        return rc
