"""The fault benchmark's router: the real workers (kvport.workers), their transfer link, one request at a time.

::

    bench (router) --control pipes--> prefill worker --TCP--> fault proxy [--> netns relays] --> decode worker
                                            |                                                        |
                                            +----------- shared tier (kvport serve) / Redis ---------+

One request (:meth:`Router.request`): ``expect`` to the decode worker, ``prefill`` (answer: the first
token and its logprob, whether the transfer committed, any fallback), ``decode`` with the first token
and the stream's expected time over the measured link (the decode worker's load deadline), answer:
the tokens and their logprobs. A worker that dies is started again (the decode worker too when the
prefill worker died: its listener takes one link) and the request is sent again under a new id: that
is a retry, counted as a recompute. A request not answered by ``hang_at`` is hung: the caller then
lifts the fault and :meth:`Workers.restart` starts both workers afresh.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvport.bench.faults.procs import Netns, ProxyProc
from kvport.errors import KVPortError, PeerError
from kvport.workers import messages
from kvport.workers.decode import main as decode_main
from kvport.workers.prefill import main as prefill_main
from kvport.workers.process import Worker

MAX_RETRIES = 2


class WorkerDied(PeerError):
    def __init__(self, role: str) -> None:
        super().__init__(f"the {role} worker died")
        self.role = role


class Hung(PeerError):
    def __init__(self, waiting_on: str) -> None:
        super().__init__(f"no answer from the {waiting_on} worker before the request's hang deadline")
        self.waiting_on = waiting_on


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    shared_port: int  # the kvport server, or a proxy in front of it (prefill worker only)
    redis_url: str | None = None
    load_deadline: tuple[float, float, float] = (1.0, 4.0, 10.0)  # DeadlinePolicy(min_s, factor, max_s)
    prefill_shared_port: int | None = None  # else shared_port


class ProxiedLink:
    """The prefill -> decode link: the frame-aware fault proxy, optionally via a network namespace."""

    def __init__(self, netns: Netns | None = None) -> None:
        self.netns = netns
        self.relays: list[ProxyProc] = []
        if netns is None:
            self.proxy = ProxyProc(("127.0.0.1", 1))
            self.last = self.proxy
            return
        try:  # here -> there:A -> here:B -> decode (the decode port is set by point_to)
            self.last = ProxyProc(("127.0.0.1", 1), listen=f"{Netns.HERE}:0", plain=True)
            self.relays.append(self.last)
            there = ProxyProc((Netns.HERE, self.last.port), listen=f"{Netns.THERE}:0", plain=True, netns=netns.name)
            self.relays.append(there)
            self.proxy = ProxyProc((Netns.THERE, there.port))
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """What the prefill worker dials: the fault proxy."""
        return f"127.0.0.1:{self.proxy.port}"

    def point_to(self, decode_port: int) -> None:
        self.last.send("upstream", host="127.0.0.1", port=decode_port)
        time.sleep(0.05)  # the command is read before the prefill worker connects

    def close(self) -> None:
        for p in [*self.relays, *([self.proxy] if hasattr(self, "proxy") else [])]:
            p.close()


@dataclass(slots=True)
class RoutedAnswer:
    rid: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    seconds: float = 0.0
    hung: str | None = None  # what it waited on, when it did not finish in time
    failed: str | None = None  # a worker's error answer
    retries: int = 0
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)

    @property
    def recomputed(self) -> bool:
        """kvport fell back: a load or transfer that failed, was refused or was late was recomputed,
        or the request was sent again after a worker died."""
        return bool(self.retries or self.prefill.get("fallback") or self.decode.get("fallback"))

    @property
    def handoff_lost(self) -> int:
        """Blocks the prefill worker recorded as handed off that the decode worker does not hold."""
        handed = int(self.prefill.get("handed_off_blocks") or 0)
        if not self.prefill.get("committed") or not self.decode:
            return 0
        return max(0, handed - int(self.decode.get("acquired_blocks") or 0))


class Workers:
    """The prefill and decode worker processes (the demo's), connected through a :class:`ProxiedLink`."""

    def __init__(self, model_dir: Path, threads: int = 1, budget_bytes: int = 4 << 20) -> None:
        self.model_dir, self.threads, self.budget = model_dir, threads, budget_bytes
        self.cfg: WorkerConfig | None = None
        self.link: ProxiedLink | None = None
        self.pw: Worker | None = None
        self.dw: Worker | None = None
        self.generation = 0
        self.starts = 0
        self.secret = secrets.token_hex(32)  # the hand-off's: both workers, never on the link itself

    def _pcfg(self, cfg: WorkerConfig) -> dict[str, Any]:
        return {"model_dir": str(self.model_dir), "shared_port": cfg.prefill_shared_port or cfg.shared_port,
                "threads": self.threads, "host_bytes": 256 << 20, "owner": "prefill", "secret": self.secret,
                "load_deadline": cfg.load_deadline, "redis_url": cfg.redis_url}

    def _dcfg(self, cfg: WorkerConfig, link: ProxiedLink) -> dict[str, Any]:
        # the prefill worker dials the proxy: the hand-off's handshake is bound to the address dialled
        return {"model_dir": str(self.model_dir), "shared_port": cfg.shared_port, "threads": self.threads,
                "budget_bytes": self.budget, "max_blocks": 1024, "owner": f"decode-{self.generation}",
                "secret": self.secret, "names": [link.address], "load_deadline": cfg.load_deadline,
                "redis_url": cfg.redis_url}

    def start(self, cfg: WorkerConfig, link: ProxiedLink) -> None:
        """Both workers with ``cfg`` over ``link`` (whatever ran before is stopped)."""
        self.close()
        self.cfg, self.link = cfg, link
        self.restart(prefill=True, decode=True)

    def restart(self, prefill: bool, decode: bool) -> None:
        cfg, link = self.cfg, self.link
        if cfg is None or link is None:
            raise PeerError("workers not configured")
        decode = decode or prefill  # a new prefill worker needs a new link: the decode listener takes one
        if prefill and self.pw is not None:
            _kill(self.pw)
        if decode and self.dw is not None:
            _kill(self.dw)
        if decode:
            self.generation += 1
            self.dw = Worker("decode-worker", decode_main, self._dcfg(cfg, link))
        if prefill:
            self.pw = Worker("prefill-worker", prefill_main, self._pcfg(cfg))
        self.starts += int(prefill) + int(decode)
        if prefill and self.pw is not None:
            self.pw.ready(600)
        if self.dw is None or self.pw is None:
            raise PeerError("workers not started")
        daddr = str(self.dw.ready(600)["address"]) if decode else None
        if daddr is not None:
            link.point_to(int(daddr.rpartition(":")[2]))
            self.pw.call({"op": "connect", "address": link.address}, 60)

    def pid(self, role: str) -> int:
        w = self.pw if role == "prefill" else self.dw
        if w is None or w.proc.pid is None:
            raise PeerError(f"no {role} worker")
        return w.proc.pid

    def signal(self, role: str, sig: int) -> None:
        with contextlib.suppress(OSError, PeerError):
            os.kill(self.pid(role), sig)

    def close(self) -> None:
        for w in (self.pw, self.dw):
            if w is not None:
                _kill(w)
        self.pw = self.dw = None


def _kill(w: Worker) -> None:
    if w.proc.is_alive() and w.proc.pid is not None:
        os.kill(w.proc.pid, signal.SIGKILL)
    w.proc.join(10)
    w.conn.close()


def _wait(w: Worker, role: str, hang_at: float) -> dict[str, Any]:
    while True:
        try:
            if w.conn.poll(0.05):
                return messages.recv(w.conn)
        except (OSError, EOFError, KVPortError):
            raise WorkerDied(role) from None
        if not w.proc.is_alive():
            raise WorkerDied(role)
        if time.monotonic() > hang_at:
            raise Hung(role)


def _send(w: Worker, role: str, msg: dict[str, Any]) -> None:
    try:
        w.send(msg)
    except (OSError, KVPortError):
        raise WorkerDied(role) from None


class Router:
    def __init__(self, workers: Workers, block_size: int, shared_prefix_tokens: int, max_new: int,
                 link_gbps: float) -> None:
        self.w = workers
        self.bs, self.shared_prefix, self.max_new = block_size, shared_prefix_tokens, max_new
        self.link_gbps = link_gbps

    def request(self, rid: str, prompt: list[int], hang_at: float) -> RoutedAnswer:
        t0 = time.monotonic()
        ans = RoutedAnswer(rid)
        while True:
            try:
                self._once(f"{rid}~{ans.retries}" if ans.retries else rid, prompt, hang_at, ans)
                break
            except WorkerDied as exc:
                if ans.retries >= MAX_RETRIES:
                    ans.failed = str(exc)
                    break
                ans.retries += 1
                self.w.restart(prefill=exc.role == "prefill", decode=True)
            except Hung as exc:
                ans.hung = exc.waiting_on
                break
        ans.seconds = time.monotonic() - t0
        return ans

    def _once(self, rid: str, prompt: list[int], hang_at: float, ans: RoutedAnswer) -> None:
        pw, dw = self.w.pw, self.w.dw
        if pw is None or dw is None:
            raise PeerError("workers not started")
        _send(dw, "decode", {"op": "expect", "rid": rid, "n_tokens": len(prompt)})
        if not _wait(dw, "decode", hang_at).get("ok"):
            raise WorkerDied("decode")
        _send(pw, "prefill", {"op": "prefill", "rid": rid, "prompt": prompt})
        p = _wait(pw, "prefill", hang_at)
        if not p.get("ok"):
            ans.failed = f"prefill worker: {p.get('error')}"
            return
        ans.prefill = p
        expected = int(p["transfer_bytes"]) / (self.link_gbps * 1e9) if self.link_gbps > 0 else None
        _send(dw, "decode", {"op": "decode", "rid": rid, "prompt": prompt, "first_token": p["first_token"],
                             "max_new": self.max_new, "hit_blocks": int(p["hit_tokens"]) // self.bs,
                             "shared_prefix_tokens": self.shared_prefix, "expected_s": expected})
        d = _wait(dw, "decode", hang_at)
        if not d.get("ok"):
            ans.failed = f"decode worker: {d.get('error')}"
            return
        ans.decode = d
        ans.tokens = [int(t) for t in d["tokens"]]
        ans.logprobs = [float(p["first_logprob"]), *(float(x) for x in d.get("logprobs") or [])]
