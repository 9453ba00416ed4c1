"""The fault classes' interface in ``kvport bench faults``: what a class does when, and what it reports.

Each class injects one kind of fault at the real component, once per injection, into the *last*
turn of a fresh chat (earlier turns run without a fault and are checked too). The runner
(:mod:`kvport.bench.faults.suite`) calls::

    prepare(env)                           once, after env.use(cls.setup)
    per injection:  [setup turns]  before(env, inj)  -> fault turn starts -> during(env, inj, turn)
                                   -> turn answered (or hung) -> after(env, inj, answer)
    finish(env)                            once, also after a failure

``inj.applied`` says the fault really happened (the proxy reported it, the signal was sent, the
file was damaged); only applied injections count in ``injected``. ``inj.lost`` is the class's own
count of committed blocks gone or wrong (see each class and docs/faults.md). A fault that holds
(a stopped process, a cut link) is lifted in ``after``, i.e. only once the request finished or its
hang deadline passed: a request that waits on it without bound is counted as hung.

:class:`Control` is the class without a fault; the transfer-path classes are
:mod:`kvport.bench.faults.link`, the storage-path classes :mod:`kvport.bench.faults.storage`.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvport.bench.faults.env import Env, Setup
from kvport.bench.faults.oracle import Chat
from kvport.bench.faults.procs import ProxyProc
from kvport.bench.faults.router import RoutedAnswer
from kvport.protocol.frame import MsgType

LAYER, BEGIN, GET = int(MsgType.LAYER), int(MsgType.TRANSFER_BEGIN), int(MsgType.GET)


@dataclass(slots=True)
class Injection:
    i: int
    chat: Chat
    applied: bool = False
    detail: str = ""
    lost: int = 0
    data: dict[str, Any] = field(default_factory=dict)


class FaultClass:
    name: ClassVar[str] = ""
    turns: ClassVar[int] = 1
    setup: ClassVar[Setup] = Setup()
    dirties_server: ClassVar[bool] = False  # the next class starts on a fresh server (and workers)

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.details: dict[str, Any] = {}

    def count(self, key: str, n: int = 1) -> None:
        self.details[key] = int(self.details.get(key, 0)) + n

    def prepare(self, env: Env) -> None:
        return None

    def before(self, env: Env, inj: Injection) -> None:
        return None

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        return None

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        return None

    def finish(self, env: Env) -> None:
        return None


def proxy_of(env: Env) -> ProxyProc:
    if env.link is None:
        raise RuntimeError("no transfer link")
    return env.link.proxy


def wait_event(proxy: ProxyProc, event: str, turn: Future[RoutedAnswer],
               timeout_s: float = 30.0) -> dict[str, Any] | None:
    """The proxy's next ``event``, or None once the turn finished without it or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ev = proxy.wait_for(event, 0.05)
        if ev is not None:
            return ev
        if turn.done():
            return proxy.wait_for(event, 0.2)
    return None


class Control(FaultClass):
    """No fault: the same chats and checks (every answer equal to the oracle, nothing recomputed)."""

    name = "none"
    turns = 2

    def before(self, env: Env, inj: Injection) -> None:
        inj.applied = True
