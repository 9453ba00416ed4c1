"""Fault classes of ``kvport bench faults`` on the transfer path (prefill worker -> decode worker).

All through the fault proxy (:mod:`kvport.bench.faults.proxy`) on the link between the workers:
``kill_prefill``, ``kill_decode``, ``wire_checksum``, ``frame_duplicate``, ``frame_missing``,
``spec_mismatch``, ``slow_reader``, ``partition``. What a class does when: :mod:`kvport.bench.faults.classes`.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import Future
from typing import Any, ClassVar

from kvport.bench.faults.classes import BEGIN, LAYER, FaultClass, Injection, proxy_of, wait_event
from kvport.bench.faults.env import Env, Setup
from kvport.bench.faults.proxy import SPEC_CHANGES
from kvport.bench.faults.router import RoutedAnswer


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
