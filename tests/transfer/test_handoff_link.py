"""The one hand-off over a real loopback link, as the demo's workers use it: a consumer that takes
each transfer itself (``on_link``) and grants credits back only as it frees what it consumed
(``auto_release=False``), both ledgers recording the commit with one transfer id."""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np
import pytest

from kvport.errors import AuthError, KVPortError
from kvport.ledger import Ledger, Move, Owner
from kvport.transfer import BlockTableDestination, Receiver, TransferMeta, nixl
from kvport.transfer.handoff import HandoffDialer, HandoffListener

from . import peers

SPEC, N = peers.SPEC, peers.N_BLOCKS
PREFILL, DECODE = Owner.engine("prefill"), Owner.engine("decode")
LAYER_BYTES = N * SPEC.bytes_per_layer_block
KEYS = peers.keys()


class Consumer:
    """The decode side: a listener whose newest link is the one read (as the demo's decode worker)."""

    def __init__(self, secret: bytes, budget: int, address: str = "127.0.0.1:0") -> None:
        self.ledger = Ledger(owners=[DECODE])
        self.dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
        self.links: list[Receiver] = []
        self.linked = threading.Condition()
        self.listener = HandoffListener(address, secret, SPEC, self._dest, budget_bytes=budget,
                                        ledger=self.ledger, owner=DECODE, auto_release=False, on_link=self._on_link)

    def _dest(self, meta: TransferMeta) -> BlockTableDestination:
        return BlockTableDestination(self.dst, range(N), meta)

    def _on_link(self, rx: Receiver) -> None:
        with self.linked:
            self.links.append(rx)
            self.linked.notify_all()

    def receiver(self, n: int = 1, timeout_s: float = 10.0) -> Receiver:
        with self.linked:
            assert self.linked.wait_for(lambda: len(self.links) >= n, timeout_s), "no authenticated link came"
            return self.links[n - 1]

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def secret() -> bytes:
    return secrets.token_bytes(32)


# TCP, and NIXL (its rings written by NIXL, UCX as it picks on this host; the control socket TCP)
LINKS = ["127.0.0.1:0", pytest.param("nixl:127.0.0.1:0", marks=pytest.mark.skipif(
    nixl.available() is not None, reason=f"{nixl.available()}"))]


def _producer(secret: bytes, address: str) -> tuple[Ledger, HandoffDialer]:
    ledger = Ledger(owners=[PREFILL])
    for k in KEYS:
        ledger.register(k, PREFILL)
    return ledger, HandoffDialer(secret, [address], ledger=ledger, owner=PREFILL, credit_timeout_s=10.0)


@pytest.mark.parametrize("address", LINKS)
def test_credits_come_back_only_as_the_consumer_frees_layers_and_the_commit_is_recorded_on_both_sides(
        secret: bytes, address: str) -> None:
    c = Consumer(secret, budget=2 * LAYER_BYTES + 4096, address=address)  # two layers and their checksums
    mine, dialer = _producer(secret, c.listener.address)
    src = peers.source()
    try:
        s = dialer.sender(c.listener.address)
        out: list[object] = []

        def send() -> None:
            try:  # layer by layer, as the prefill worker streams
                h = s.begin(TransferMeta(SPEC, "r1", KEYS))
                for i in h.meta.layers:
                    s.send_layer(h, i, peers.layer_views(src, SPEC, i))
                s.end(h)
                out.append(h)
            except KVPortError as exc:
                out.append(exc)

        th = threading.Thread(target=send)
        th.start()
        rx = c.receiver()
        inc = rx.next_transfer(timeout=10)
        inc.wait_for_layer(1, timeout=10)
        time.sleep(0.3)  # room for a third layer, were credits granted without the consumer
        assert not inc.layer_ready(2), "a layer arrived beyond the budget before the consumer freed any"
        for i in range(SPEC.num_layers):
            inc.wait_for_layer(i, timeout=10)
            rx.release(LAYER_BYTES, inc)  # consumed: its bytes go back as credits
        inc.wait(timeout=10)
        th.join(10)
        h = out[0]
        assert not isinstance(h, BaseException), h
        assert np.array_equal(c.dst, src)
        handed = [(r.key, str(r.owner_to), r.tid) for r in mine.history if r.move is Move.HANDED_OFF]
        acquired = [(r.key, str(r.owner_from), r.tid) for r in c.ledger.history if r.move is Move.ACQUIRE]
        tid = inc.ledger_tid
        assert tid and handed == [(k, str(DECODE), tid) for k in KEYS]
        assert acquired == [(k, str(PREFILL), tid) for k in KEYS]
        assert PREFILL in c.ledger.peers  # admitted over the authenticated link, not configured
        dialer.keep(c.listener.address, s)
    finally:
        dialer.close()
        c.close()


@pytest.mark.parametrize("address", LINKS)
def test_a_new_link_is_handed_to_the_consumer_and_a_wrong_secret_never_is(secret: bytes, address: str) -> None:
    c = Consumer(secret, budget=1 << 20, address=address)
    try:
        _, first = _producer(secret, c.listener.address)
        a = first.sender(c.listener.address)
        rx1 = c.receiver(1)
        _, second = _producer(secret, c.listener.address)
        b = second.sender(c.listener.address)
        rx2 = c.receiver(2)
        assert rx1 is not rx2
        _, intruder = _producer(secrets.token_bytes(32), c.listener.address)
        with pytest.raises(AuthError):
            intruder.sender(c.listener.address)
        time.sleep(0.2)
        assert len(c.links) == 2  # the refused dial never reached the consumer
        a.close()
        b.close()
    finally:
        c.close()
