"""Links between hosts, emulated: two network namespaces joined by a veth pair shaped with ``tc netem``.

::

    namespace kvp-<tag>-a                         namespace kvp-<tag>-b
      lo (up), kvp<tag>a 10.213.X.1/30  <--veth-->  kvp<tag>b 10.213.X.2/30, lo (up)
      netem: rate R, delay D, loss L                 netem: rate R, delay D, loss L

Each direction is shaped alike, so a round trip takes ``2 D`` plus serialisation. Where the kernel
has no ``sch_netem`` (this VM's: "Specified qdisc kind is unknown"; ``tbf`` and ``htb`` are there),
the rate is shaped with ``tbf`` instead and the delay is not emulated: :attr:`ShapedLink.delay_emulated`
is False, :meth:`ShapedLink.describe` says so, and every figure taken over such a link carries it.
The named shapes
(:data:`LINKS`) are the ones the benchmarks and tests use: a rack's 10 Gb/s at 50 us a way, and a
1 Gb/s link at 1 ms a way (another building, a busy fabric).

A process enters a namespace for the sockets it makes next with :func:`in_netns` (``setns(2)`` on
the calling thread; threads and processes it starts afterwards inherit it), so one benchmark
process can be host A while a spawned child is host B. Needs root (or CAP_NET_ADMIN), ``ip`` and
``tc``: :func:`unavailable` says why not, and callers report that instead of a number.
Nothing here touches an interface outside the namespaces it created; :meth:`ShapedLink.close`
deletes both (the veth pair goes with them), also after a failed start.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvport.errors import ConfigError

_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True, slots=True)
class LinkShape:
    rate_mbit: float  # each direction
    delay_us: float  # one way
    loss_pct: float = 0.0

    @property
    def rate_bps(self) -> float:
        """Bytes per second."""
        return self.rate_mbit * 1e6 / 8

    def ideal_s(self, nbytes: int) -> float:
        """The time a transfer of ``nbytes`` takes at best: one way's delay, then the bytes at the rate."""
        return self.delay_us * 1e-6 + nbytes / self.rate_bps


LINKS: dict[str, LinkShape] = {
    "10g-50us": LinkShape(10_000, 50),
    "1g-1ms": LinkShape(1_000, 1_000),
}


def shape_of(name: str) -> LinkShape:
    try:
        return LINKS[name]
    except KeyError:
        raise ConfigError(f"unknown link {name!r}; known: {', '.join(LINKS)}") from None


def _basic_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    for exe in ("ip", "tc"):
        if shutil.which(exe) is None:
            return f"{exe} (iproute2) is not installed"
    return None


@functools.cache
def unavailable() -> str | None:
    """Why shaped links cannot be made here (None: they can): root, iproute2, and a namespace with a
    veth pair made and removed once to be sure (a container may refuse them)."""
    why = _basic_unavailable()
    if why is not None:
        return why
    probe = ShapedLink("probe", LinkShape(1000, 0))
    try:
        probe.start()
    except ConfigError as exc:
        return f"cannot make a namespace with a shaped veth here: {exc}"
    finally:
        probe.close()
    return None


def _run(*args: str) -> None:
    try:
        subprocess.run(args, check=True, capture_output=True, text=True, timeout=20)
    except subprocess.CalledProcessError as exc:
        raise ConfigError(f"{' '.join(args)}: {exc.stderr.strip() or exc.returncode}") from exc
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{' '.join(args)}: {exc}") from exc


class ShapedLink:
    """Two namespaces and a shaped veth between them (module docstring). A context manager."""

    def __init__(self, name: str, shape: LinkShape | None = None) -> None:
        self.name = name
        self.shape = shape or shape_of(name)
        tag = secrets.token_hex(3)
        self.ns = (f"kvp-{tag}-a", f"kvp-{tag}-b")
        self.dev = (f"kvp{tag}a", f"kvp{tag}b")
        net = int.from_bytes(secrets.token_bytes(1), "little")
        self.addr = (f"10.213.{net}.1", f"10.213.{net}.2")
        self.up = False
        self.delay_emulated = True  # until netem proves missing

    def netem(self) -> list[str]:
        s = self.shape
        if not self.delay_emulated:  # rate only: a token bucket, bursts of 1 ms of the rate (at least 64 KiB + MTU)
            burst = max(70_000, int(s.rate_bps * 1e-3))
            return ["tbf", "rate", f"{s.rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]
        args = ["netem", "delay", f"{s.delay_us:g}us", "rate", f"{s.rate_mbit:g}mbit", "limit", "100000"]
        return args + (["loss", f"{s.loss_pct:g}%"] if s.loss_pct else [])

    def _shape(self, ns: str, dev: str) -> None:
        try:
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *self.netem())
        except ConfigError as exc:
            if not self.delay_emulated or "qdisc kind is unknown" not in str(exc):
                raise
            self.delay_emulated = False
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *self.netem())

    def start(self) -> ShapedLink:
        why = _basic_unavailable()
        if why is not None:
            raise ConfigError(f"cannot emulate link {self.name}: {why}")
        try:
            for ns in self.ns:
                _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape(ns, dev)
            self.up = True
        except BaseException:
            self.close()
            raise
        return self

    def set_loss(self, pct: float) -> None:
        """Change both directions' loss now (a link that starts dropping packets mid-run; netem only)."""
        if not self.delay_emulated:
            raise ConfigError("this kernel has no sch_netem: packet loss cannot be emulated")
        self.shape = LinkShape(self.shape.rate_mbit, self.shape.delay_us, pct)
        for ns, dev in zip(self.ns, self.dev, strict=True):
            _run("tc", "-n", ns, "qdisc", "change", "dev", dev, "root", *self.netem())

    def qdisc(self, side: int) -> str:
        out = subprocess.run(["tc", "-n", self.ns[side], "qdisc", "show", "dev", self.dev[side]],
                             check=False, capture_output=True, text=True, timeout=10)
        return out.stdout

    def close(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=20)
        self.up = False

    def __enter__(self) -> ShapedLink:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        s = self.shape
        return {"rate_mbit": s.rate_mbit, "delay_us_one_way": s.delay_us if self.delay_emulated else None,
                "delay_us_asked": s.delay_us, "loss_pct": s.loss_pct, "delay_emulated": self.delay_emulated,
                "emulation": "veth pair between two network namespaces, tc on both ends (each direction): "
                             + " ".join(self.netem()),
                **({} if self.delay_emulated else {
                    "delay_reason": "this kernel has no sch_netem (tc: 'Specified qdisc kind is unknown'); the "
                                    "rate is shaped with tbf, the delay is the veth's own"})}


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise ConfigError(f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """This thread in namespace ``name`` inside the block (sockets made there belong to it), back after."""
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    except OSError as exc:
        os.close(back)
        raise ConfigError(f"no network namespace {name!r}: {exc}") from exc
    try:
        _setns(fd)
        yield
    finally:
        os.close(fd)
        _setns(back)
        os.close(back)


def enter_netns(name: str) -> None:
    """This thread (a child process's main thread, at its start) in namespace ``name`` for good."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)
