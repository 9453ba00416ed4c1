"""Fault classes of ``kvport bench faults`` on the transfer path (prefill worker -> decode worker).

Each class injects one kind of fault at the real component, once per injection, into the *last*
turn of a fresh chat (earlier turns run without a fault and are checked too). The runner calls::

    prepare(env)                           once, after env.use(cls.setup)
    per injection:  [setup turns]  before(env, inj)  -> fault turn starts -> during(env, inj, turn)
                                   -> turn answered (or hung) -> after(env, inj, answer)
    finish(env)                            once, also after a failure

``inj.applied`` says the fault really happened (the proxy reported it, the signal was sent, the
file was damaged); only applied injections count in ``injected``. ``inj.lost`` is the class's own
count of committed blocks gone or wrong (see each class and docs/faults.md). A fault that holds
(a stopped process, a cut link) is lifted in ``after``, i.e. only once the request finished or its
hang deadline passed: a request that waits on it without bound is counted as hung.

Transfer-path classes, all through the fault proxy (:mod:`kvport.bench.faults_proxy`):
``kill_prefill``, ``kill_decode``, ``wire_checksum``, ``frame_duplicate``, ``frame_missing``,
``spec_mismatch``, ``slow_reader``, ``partition``; storage classes are in
:mod:`kvport.bench.faults_store`.
"""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvport.bench.faults_env import Env, Setup
from kvport.bench.faults_oracle import Chat
from kvport.bench.faults_procs import ProxyProc
from kvport.bench.faults_proxy import SPEC_CHANGES
from kvport.bench.faults_router import RoutedAnswer
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


class _ProxyFault(FaultClass):
    """Arm one proxy action on a LAYER frame of the fault turn (a random one of the stream)."""

    action: ClassVar[str] = ""

    def arm(self, env: Env, inj: Injection, **kw: Any) -> None:
        p = proxy_of(env)
        p.drain()
        p.send("arm", **kw)

    def before(self, env: Env, inj: Injection) -> None:
        inj.data["nth"] = self.rng.randint(1, env.spec.num_layers)
        self.arm(env, inj, action=self.action, type=LAYER, nth=inj.data["nth"])

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        ev = wait_event(proxy_of(env), "injected", turn)
        inj.applied = ev is not None
        inj.detail = "" if ev is not None else "the stream ended before the armed frame"

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        proxy_of(env).send("disarm")


class WireChecksum(_ProxyFault):
    """One bit of one block-layer flipped on the wire: the receiver's checksum refuses the transfer."""

    name, action = "wire_checksum", "flip"


class FrameDuplicate(_ProxyFault):
    """One LAYER frame delivered twice: a repeated block-layer aborts the transfer."""

    name, action = "frame_duplicate", "dup"


class FrameMissing(_ProxyFault):
    """One LAYER frame never delivered: the transfer cannot complete (refused at its end, or late)."""

    name, action = "frame_missing", "drop"


class SpecMismatch(_ProxyFault):
    """The TRANSFER_BEGIN announces a spec that differs in one compatibility field (each field in
    turn): the receiver refuses before any payload and names the field."""

    name = "spec_mismatch"
    FIELDS: ClassVar[tuple[str, ...]] = tuple(SPEC_CHANGES)

    def before(self, env: Env, inj: Injection) -> None:
        inj.data["field"] = self.FIELDS[(inj.i - 1) % len(self.FIELDS)]
        self.arm(env, inj, action="spec", type=BEGIN, nth=1, field=inj.data["field"])

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        super().after(env, inj, ans)
        f = inj.data["field"]
        named = "tp_size" if f == "tp_rank" else f  # a tp_rank alone cannot differ from a tp_size-1 spec
        err = str((ans.prefill if ans else {}).get("transfer_error") or "")
        row = self.details.setdefault("by_field", {}).setdefault(f, {"injected": 0, "refused_naming_it": 0})
        row["injected"] += int(inj.applied)
        row["refused_naming_it"] += int(inj.applied and "IncompatibleSpec" in err and named in err)


class _Kill(FaultClass):
    """SIGKILL of a worker in the middle of the stream (the proxy holds the stream at a random
    LAYER frame, the worker dies, the stream goes on into the broken link). The router starts the
    dead worker again and sends the request again."""

    role: ClassVar[str] = ""

    def before(self, env: Env, inj: Injection) -> None:
        p = proxy_of(env)
        p.drain()
        inj.data["nth"] = self.rng.randint(1, env.spec.num_layers - 1)
        p.send("arm", action="hold", type=LAYER, nth=inj.data["nth"])

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        p = proxy_of(env)
        if wait_event(p, "held", turn) is None:
            inj.detail = "the stream ended before the armed frame"
            return
        env.workers.signal(self.role, signal.SIGKILL)
        inj.applied = True
        p.send("release")

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        proxy_of(env).send("disarm")
        if ans is not None:
            self.count("retried_requests", int(ans.retries > 0))


class KillPrefill(_Kill):
    name, role = "kill_prefill", "prefill"


class KillDecode(_Kill):
    name, role = "kill_decode", "decode"


class SlowReader(FaultClass):
    """A slow consumer: odd injections throttle the link to ``THROTTLE_BPS`` (the proxy reads the
    sender slowly), even ones stop the decode worker for ``PAUSE_S`` mid-receive (SIGSTOP, SIGCONT).
    Backpressure (credits, socket buffers) must hold the sender; nothing is lost or recomputed."""

    name = "slow_reader"
    THROTTLE_BPS: ClassVar[float] = 4e6
    PAUSE_S: ClassVar[float] = 1.5

    def before(self, env: Env, inj: Injection) -> None:
        p = proxy_of(env)
        p.drain()
        inj.data["mode"] = "throttle" if inj.i % 2 else "pause"
        if inj.data["mode"] == "throttle":
            p.send("arm", action="throttle", bps=self.THROTTLE_BPS)
            inj.applied = True
        else:
            p.send("arm", action="hold", type=LAYER, nth=self.rng.randint(1, env.spec.num_layers // 2))

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        if inj.data["mode"] == "throttle":
            return
        p = proxy_of(env)
        if wait_event(p, "held", turn) is None:
            inj.detail = "the stream ended before the armed frame"
            return
        env.workers.signal("decode", signal.SIGSTOP)
        inj.applied = True
        p.send("release")
        time.sleep(self.PAUSE_S)
        env.workers.signal("decode", signal.SIGCONT)

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        env.workers.signal("decode", signal.SIGCONT)
        proxy_of(env).send("disarm")
        if inj.applied:
            self.count(f"{inj.data['mode']}_injections")


class Partition(FaultClass):
    """The link between the workers runs through a network namespace (veth); mid-stream the veth is
    set down and stays down until the request is answered (or its hang deadline passed)."""

    name = "partition"
    setup = Setup(netns=True)

    def before(self, env: Env, inj: Injection) -> None:
        p = proxy_of(env)
        p.drain()
        p.send("arm", action="hold", type=LAYER, nth=self.rng.randint(1, env.spec.num_layers - 1))

    def during(self, env: Env, inj: Injection, turn: Future[RoutedAnswer]) -> None:
        p = proxy_of(env)
        if wait_event(p, "held", turn) is None or env.netns is None:
            inj.detail = "the stream ended before the armed frame"
            return
        env.netns.down()
        inj.applied = True
        p.send("release")

    def after(self, env: Env, inj: Injection, ans: RoutedAnswer | None) -> None:
        if env.netns is not None:
            env.netns.up()
        proxy_of(env).send("disarm")


LINK_CLASSES: tuple[type[FaultClass], ...] = (
    WireChecksum, FrameDuplicate, FrameMissing, SpecMismatch, SlowReader, KillPrefill, KillDecode, Partition,
)
