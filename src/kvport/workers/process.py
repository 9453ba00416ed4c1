"""A worker process and its control pipe, as the demo's router and the fault benchmark drive them.

::

    Worker(name, target, cfg)   spawn ``target(conn, cfg)`` (a fresh interpreter: no fork of the caller)
    ready(timeout_s)            the worker's first message: ``ok`` and what it listens on, or its error
    call(msg) / send + recv     one request, one answer (``ok`` or ``error``); a dead worker or no answer
                                in time is a PeerError, never a wait without bound
    stop() / kill()             ``op: stop`` then terminate; terminate only
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.process import BaseProcess
from typing import Any

from kvport.errors import KVPortError, PeerError
from kvport.workers import messages


class Worker:
    """A spawned worker process (``target(conn, cfg)``, e.g. :func:`kvport.workers.prefill.main`) and
    its control pipe."""

    def __init__(self, name: str, target: Any, cfg: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc: BaseProcess = ctx.Process(target=target, args=(child, cfg), name=name, daemon=True)
        self.proc.start()
        child.close()

    def ready(self, timeout_s: float) -> dict[str, Any]:
        msg = self.recv(timeout_s)
        if not msg.get("ok"):
            raise PeerError(f"{self.name} failed to start: {msg.get('error')}")
        return msg

    def recv(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.conn.poll(0.2):
                return messages.recv(self.conn)
            if not self.proc.is_alive():
                raise PeerError(f"{self.name} exited (code {self.proc.exitcode})")
        raise PeerError(f"{self.name}: no answer within {timeout_s} s")

    def call(self, msg: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        self.send(msg)
        ans = self.recv(timeout_s)
        if not ans.get("ok"):
            raise PeerError(f"{self.name}: {ans.get('error')}")
        return ans

    def send(self, msg: dict[str, Any]) -> None:
        messages.send(self.conn, msg)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(10)
        self.conn.close()

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call({"op": "stop"}, timeout_s=20)
        except (KVPortError, OSError):
            pass
        self.kill()
