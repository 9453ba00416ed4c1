"""The vLLM rows' fault classes: each injects one fault into one request through the deployment.

:class:`VClass` is the interface (``inject`` a prompt, get its :class:`~kvport.bench.faults.vllm_env.Outcome`;
``keeps``: the hand-off must survive whole); :data:`CLASSES` by name, :data:`QUICK` the ``--quick`` subset.
The rule each class is held to is in docs/faults.md.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import time
from typing import Any

from kvport.bench.faults.proxy import SPEC_CHANGES
from kvport.bench.faults.vllm_env import BLOCK, INBOX_TOKENS, LEASE_S, Outcome, VllmEnv, random_prompt
from kvport.errors import KVPortError
from kvport.protocol.frame import MsgType


class VClass:
    """One fault class: ``inject`` runs the faulted request and returns its outcome; ``keeps``: the
    hand-off must survive the fault whole (every handed-over token loaded)."""

    name = ""
    keeps = False
    promise = ""

    def __init__(self, env: VllmEnv, rng: random.Random) -> None:
        self.env, self.rng = env, rng
        self.applied = True  # the last injection's fault really happened (set by inject)

    def inject(self, prompt: list[int]) -> Outcome:
        raise NotImplementedError

    def finish(self) -> None:
        """Lift whatever the class left behind (after its last injection)."""

    def _armed(self, prompt: list[int], **arm: Any) -> Outcome:
        env = self.env
        env.fproxy.drain()
        env.fproxy.send("arm", **arm)
        out = env.ask(lambda: env.via_proxy(prompt))
        self.applied = any(ev.get("event") == "injected" for ev in env.fproxy.drain())
        env.fproxy.send("disarm")
        return out


def _layers() -> int:
    return 30  # SmolLM2-135M: 30 layers; a step's stream sends one LAYER frame per layer


class StreamCut(VClass):
    name = "stream_cut"
    keeps = True
    promise = "a stream that misses a layer links nothing; the producer saves the blocks, the decode engine loads them"

    def inject(self, prompt: list[int]) -> Outcome:
        return self._armed(prompt, action="drop", type=int(MsgType.LAYER), nth=self.rng.randrange(1, _layers() + 1))


class LayerCorrupted(VClass):
    name = "layer_corrupted"
    keeps = True
    promise = "a block-layer flipped in flight fails its checksum: nothing linked, the store copy loads"

    def inject(self, prompt: list[int]) -> Outcome:
        return self._armed(prompt, action="flip", type=int(MsgType.LAYER), nth=self.rng.randrange(1, _layers() + 1))


class LayerDuplicated(VClass):
    name = "layer_duplicated"
    keeps = True
    promise = "a block-layer sent twice aborts the transfer (exactly once): the store copy loads"

    def inject(self, prompt: list[int]) -> Outcome:
        return self._armed(prompt, action="dup", type=int(MsgType.LAYER), nth=self.rng.randrange(1, _layers() + 1))


class VllmSpecMismatch(VClass):
    name = "spec_mismatch"
    keeps = True
    promise = "a TRANSFER_BEGIN for another spec (each compat field) is refused before any byte: the store copy loads"

    def __init__(self, env: VllmEnv, rng: random.Random) -> None:
        super().__init__(env, rng)
        self.fields = sorted(SPEC_CHANGES)
        self.i = 0

    def inject(self, prompt: list[int]) -> Outcome:
        f = self.fields[self.i % len(self.fields)]
        self.i += 1
        return self._armed(prompt, action="spec", type=int(MsgType.TRANSFER_BEGIN), nth=1, field=f)


class StreamReused(VClass):
    name = "stream_reused"
    promise = "a stream id replayed, or named with another prompt, links nothing it did not bring for that prompt"

    def __init__(self, env: VllmEnv, rng: random.Random) -> None:
        super().__init__(env, rng)
        self.i = 0

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env
        first = random.Random(self.rng.random()).sample(range(200, 30000), 256 + BLOCK)
        params = env.prefill(first)
        env.decode(first, params)  # takes the stream
        self.i += 1
        if self.i % 2:  # replayed: the same id again, for the prompt it carried
            env.reference(first)
            out = env.ask(lambda: env.decode(first, params))
            out.prompt = first
            return out
        return env.ask(lambda: env.decode(prompt, params))  # foreign: another prompt names the spent id


class InboxFull(VClass):
    name = "inbox_full"
    keeps = True
    promise = "a full inbox refuses the stream at TRANSFER_BEGIN: the producer saves, the decode engine loads"

    def inject(self, prompt: list[int]) -> Outcome:
        from kvport.engines.vllm.params import new_stream_id
        from kvport.ledger import Ledger
        from kvport.protocol.transfer import TransferMeta
        from kvport.transfer import links
        from kvport.transfer.handoff import AuthenticatedPeers, engine_owner
        from kvport.transfer.sender import Sender

        env = self.env
        if env.spec is None:
            env.prefill(random_prompt(self.rng, 2 * BLOCK, 3 * BLOCK))
        assert env.spec is not None
        n = INBOX_TOKENS // BLOCK - 1  # leaves one block: the hand-off needs more
        keys = tuple(secrets.token_bytes(16) for _ in range(n))
        zero = memoryview(bytearray(env.spec.bytes_per_layer_block))
        # a member of the deployment fills it, never takes it (recorded as every hand-off is: the inbox
        # refuses a sender whose transfers name no ledger owner)
        me = engine_owner("prefill", "inbox-filler")
        led = Ledger(owners=[me])
        for k in keys:
            led.register(k, me)
        s = Sender(links.dial(env.inbox, env.secret), ledger=led, owner=me, admit_peer=AuthenticatedPeers(led))
        try:
            s.send(TransferMeta(env.spec, new_stream_id(), keys), lambda layer: [zero] * n, timeout_s=30.0)
        except KVPortError:
            pass  # the inbox held another filler already: full either way
        finally:
            s.close()
        refused = env.decode_count("refused")
        out = env.ask(lambda: env.via_proxy(prompt))
        self.applied = env.decode_count("refused") > refused
        return out

    def finish(self) -> None:
        time.sleep(LEASE_S + 1)  # the fillers lapse (nobody takes them): the inbox has room again


class _Signalled(VClass):
    """A process stopped (SIGSTOP) ``hold_s`` after the request went out, continued ``freeze_s`` later."""

    freeze_s = 3.0

    def pid(self) -> int:
        raise NotImplementedError

    def _group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid(), sig)

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env

        def freeze() -> None:
            time.sleep(self.rng.uniform(0.05, 0.5))
            self._group(signal.SIGSTOP)
            time.sleep(self.freeze_s)
            self._group(signal.SIGCONT)

        return env.ask(lambda: env.via_proxy(prompt), freeze)


class ProducerFrozen(_Signalled):
    name = "producer_frozen"
    keeps = True
    promise = "a producer stopped mid-stream for seconds resumes: the hand-off commits, nothing hangs"

    def pid(self) -> int:
        assert self.env.pre.proc is not None
        return self.env.pre.proc.pid


class ServerStalled(_Signalled):
    name = "server_stalled"
    keeps = True
    promise = "a stalled shared tier delays nothing the stream carries: answers right, within the deadline"

    def pid(self) -> int:
        return self.env.server.pid

    def _group(self, sig: int) -> None:
        self.env.server.signal(sig)


class ServerKilled(VClass):
    name = "server_killed"
    promise = "the shared tier killed mid-request: the stream needs no server, the answer is right; restarted"

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env

        def kill() -> None:
            time.sleep(self.rng.uniform(0.0, 0.5))
            env.server.kill()

        out = env.ask(lambda: env.via_proxy(prompt), kill)
        env.server.start()
        return out


class ProducerKilled(VClass):
    name = "producer_killed"
    promise = "the prefill engine killed mid-stream: nothing partial linked, the decode engine recomputes"

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env

        def kill() -> None:
            time.sleep(self.rng.uniform(0.05, 0.6))
            env.pre.kill()

        out = env.ask(lambda: env.via_proxy(prompt), kill)
        env.restart(env.pre)
        return out


class DecodeKilledBeforeLoad(VClass):
    name = "decode_killed_before_load"
    promise = "the decode engine dies after the hand-off committed: its restart finds the store's copy or recomputes"

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env
        params = env.prefill(prompt)
        env.dec.kill()
        env.restart(env.dec)
        return env.ask(lambda: env.decode(prompt, params))


class DecodeKilledDuringLoad(VClass):
    name = "decode_killed_during_load"
    promise = "the decode engine killed while it loads: the proxy serves the request from a prefill engine"

    def inject(self, prompt: list[int]) -> Outcome:
        env = self.env

        def kill() -> None:
            time.sleep(self.rng.uniform(0.2, 1.2))  # the prefill (~0.2-1 s here), then the decode's load
            env.dec.kill()

        out = env.ask(lambda: env.via_proxy(prompt), kill)
        env.restart(env.dec)
        return out


class VllmDiskFull(VClass):
    name = "disk_full"
    keeps = True
    promise = "the engines' disk tier full: the stream lands, saves that do not fit are dropped, answers right"

    def inject(self, prompt: list[int]) -> Outcome:
        self.env.disk.fill(leave_bytes=0)
        try:
            return self.env.ask(lambda: self.env.via_proxy(prompt))
        finally:
            self.env.disk.unfill()


CLASSES: dict[str, type[VClass]] = {c.name: c for c in (
    StreamCut, LayerCorrupted, LayerDuplicated, VllmSpecMismatch, StreamReused, InboxFull, ProducerFrozen,
    ServerStalled, VllmDiskFull, ServerKilled, ProducerKilled, DecodeKilledBeforeLoad, DecodeKilledDuringLoad)}
QUICK = ("stream_cut", "layer_corrupted", "spec_mismatch", "stream_reused", "inbox_full")
