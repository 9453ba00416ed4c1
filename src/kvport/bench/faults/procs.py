"""The real components the fault benchmark starts, breaks and restarts, one handle each.

::

    ServerProc   ``python -m kvport.cli.serve_cmd`` on one fixed 127.0.0.1 port (a restart, or the next
                 class's server, takes the same port, so the workers' clients reconnect to it)
    RedisProc    ``redis-server`` without persistence on a free port (a restart is an empty Redis)
    ProxyProc    :mod:`kvport.bench.faults.proxy`: JSON commands in, events out
    Netns        a network namespace and a veth pair (10.77.0.1 here, 10.77.0.2 there); the link
                 between prefill and decode worker crosses it twice (see :class:`Netns`)
    Tmpfs        a small tmpfs for the server's ``--disk``, and a filler file that leaves it full

Every handle ends what it started in ``close`` (also after a failure); nothing is ended by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from kvport.config import subprocess_env
from kvport.errors import ConfigError, PeerError, ServerError

_ENV = {"KVPORT_LOG_LEVEL": "ERROR"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_line(stream: IO[str] | None, timeout_s: float) -> str:
    """The first line a child prints, or "" after ``timeout_s`` (read on a helper thread)."""
    out: queue.Queue[str] = queue.Queue()
    if stream is None:
        return ""
    threading.Thread(target=lambda: out.put(stream.readline()), daemon=True).start()
    try:
        return out.get(timeout=timeout_s)
    except queue.Empty:
        return ""


def _end(proc: subprocess.Popen[Any] | None, sig: int = signal.SIGTERM, wait_s: float = 20.0) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.send_signal(sig)
            return proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


class ServerProc:
    """``kvport serve`` (host + disk) on ``port``; ``args`` are its options besides ``--listen``."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.args: list[str] = []
        self.info: dict[str, Any] = {}

    def start(self, args: list[str] | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        if args is not None:
            self.args = args
        cmd = [sys.executable, "-m", "kvport.cli.serve_cmd", "--listen", f"127.0.0.1:{self.port}", *self.args]
        deadline = time.monotonic() + timeout_s
        while True:  # the port of a server just killed may take a moment to be free again
            with self.log.open("a") as err:
                self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                             env=subprocess_env(_ENV))
            line = _first_line(self.proc.stdout, max(1.0, deadline - time.monotonic()))
            try:
                self.info = json.loads(line)
                return self.info
            except ValueError:
                rc = _end(self.proc, signal.SIGKILL)
                self.proc = None
                if time.monotonic() > deadline:
                    raise ServerError(f"kvport serve did not start (rc {rc}): {self.tail()}") from None
                time.sleep(0.5)

    def tail(self, n: int = 600) -> str:
        try:
            return self.log.read_text()[-n:].strip()
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ServerError("kvport serve is not running")
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (the fault): nothing is drained, spilled or fsynced."""
        _end(self.proc, signal.SIGKILL)
        self.proc = None

    def stop(self) -> int | None:
        rc = _end(self.proc, signal.SIGTERM, 30.0)
        self.proc = None
        return rc


class RedisProc:
    def __init__(self, folder: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ConfigError("redis-server not found (make installs it; apt-get install redis-server)")
        self.exe = exe
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.folder)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise PeerError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        _end(self.proc, signal.SIGKILL)
        self.proc = None

    def close(self) -> None:
        _end(self.proc)
        self.proc = None


class ProxyProc:
    """A :mod:`kvport.bench.faults.proxy` process and its event stream."""

    def __init__(self, upstream: tuple[str, int], listen: str = "127.0.0.1:0", plain: bool = False,
                 netns: str | None = None) -> None:
        cmd = [sys.executable, "-m", "kvport.bench.faults.proxy", "--listen", listen,
               "--upstream", f"{upstream[0]}:{upstream[1]}", *(["--plain"] if plain else [])]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=subprocess_env(_ENV))
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.conn = 0  # the connection accepted last (0: none yet)
        self.closed: set[int] = set()
        self.closed_why: list[str] = []
        line = _first_line(self.proc.stdout, 30.0)
        try:
            self.port = int(json.loads(line)["port"])
        except (ValueError, KeyError) as exc:
            self.close()
            raise PeerError(f"fault proxy did not start: {line!r}") from exc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "accepted":
                self.conn = int(ev.get("conn", 0))
            elif ev.get("event") == "closed" and ev.get("conn"):
                self.closed.add(int(ev["conn"]))
                self.closed_why.append(str(ev.get("why", "")))
            self.events.put(ev)

    @property
    def linked(self) -> bool:
        """A connection runs through the proxy now (the last one accepted has not closed)."""
        return self.conn > 0 and self.conn not in self.closed

    def send(self, cmd: str, **kw: Any) -> None:
        if self.proc.stdin is None or self.proc.poll() is not None:
            raise PeerError("fault proxy is not running")
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while not self.events.empty():
            out.append(self.events.get_nowait())
        return out

    def wait_for(self, event: str, timeout_s: float) -> dict[str, Any] | None:
        """The next ``event`` (others are skipped), or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if ev.get("event") == event:
                return ev
        return None

    def close(self) -> None:
        with contextlib.suppress(PeerError, OSError):
            self.send("quit")
        _end(self.proc, signal.SIGTERM, 5.0)


class Netns:
    """A namespace ``name`` joined to this one by a veth pair; :meth:`down` cuts it, :meth:`up` mends it.

    The prefill worker's link runs through it and back, so every byte crosses the veth twice::

        prefill -> fault proxy (here) -> 10.77.0.2:A relay (there) -> 10.77.0.1:B relay (here) -> decode
    """

    HERE, THERE = "10.77.0.1", "10.77.0.2"

    def __init__(self, name: str = "kvpfault") -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise ConfigError("a network namespace needs root and iproute2 (ip)")
        self.name, self.veth = name, f"{name}0"
        self.made = False
        if name in subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout.split():
            self._ip("netns", "del", name)  # left by a run that was killed: ours by its name
        self._ip("netns", "add", name)
        self.made = True
        self._ip("link", "add", self.veth, "type", "veth", "peer", "name", f"{name}1", "netns", name)
        self._ip("addr", "add", f"{self.HERE}/24", "dev", self.veth)
        self._ip("link", "set", self.veth, "up")
        self._ip("netns", "exec", name, "ip", "addr", "add", f"{self.THERE}/24", "dev", f"{name}1")
        self._ip("netns", "exec", name, "ip", "link", "set", f"{name}1", "up")
        self._ip("netns", "exec", name, "ip", "link", "set", "lo", "up")

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
        if r.returncode:
            raise ConfigError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def down(self) -> None:
        self._ip("link", "set", self.veth, "down")

    def up(self) -> None:
        self._ip("link", "set", self.veth, "up")

    def close(self) -> None:
        if self.made:
            subprocess.run(["ip", "link", "del", self.veth], check=False, capture_output=True)
            subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)
            self.made = False


class Tmpfs:
    """A tmpfs of ``size_bytes`` at ``path`` (root), or a plain folder when mounting is not allowed
    (``mounted`` says which: the filler file then fills the folder's file system)."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                           check=False, capture_output=True, text=True)
        self.mounted = r.returncode == 0
        self.filler = path / "filler.bin"

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return int(st.f_bavail * st.f_frsize)

    def fill(self, leave_bytes: int) -> int:
        """Take all but ``leave_bytes`` of the free space with one file; returns its size."""
        self.unfill()
        n = max(0, self.free_bytes() - leave_bytes)
        if n:
            fd = os.open(self.filler, os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.posix_fallocate(fd, 0, n)
            finally:
                os.close(fd)
        return n

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        self.unfill()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
            self.mounted = False
