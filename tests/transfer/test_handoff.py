"""Ownership on the wire: a transfer's commit is a hand-off recorded by both ledgers (issue 15).

One process, in-process transport; the two ledgers stand for the two processes (the test with real
processes is in test_two_process.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvport.errors import IllegalMoveError, TierFullError, TransferError, UnknownPeerError
from kvport.ledger import BlockState, Ledger, Move, Owner
from kvport.transfer import BlockTableDestination, Receiver, Sender, TransferMeta, inproc
from kvport.transfer.meta import TransferMeta as Meta

from . import peers

SPEC, N = peers.SPEC, peers.N_BLOCKS
PREFILL, DECODE = Owner.engine("prefill"), Owner.engine("decode")


class Pair:
    """A sender (prefill's ledger) and a receiver (decode's ledger) on one in-process connection."""

    def __init__(self, sender_peer: Owner | None = DECODE, receiver_owner: Owner = DECODE,
                 receiver_peers: tuple[Owner, ...] = (PREFILL,), receiver_ledger: bool = True,
                 dest: type[BlockTableDestination] = BlockTableDestination) -> None:
        self.mine, self.theirs = Ledger(), Ledger()
        self.keys = peers.keys()
        for k in self.keys:
            self.mine.register(k, PREFILL)
        self.dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
        a, b = inproc.pair()
        kw = {"ledger": self.theirs, "owner": receiver_owner, "peers": receiver_peers} if receiver_ledger else {}
        self.rx = Receiver(b, SPEC, lambda m: dest(self.dst, range(N), m), budget_bytes=1 << 20, **kw)  # type: ignore[arg-type]
        self.rx.start()
        self.tx = Sender(a, ledger=self.mine, owner=PREFILL, peer=sender_peer)
        self.src = peers.source()

    def meta(self) -> Meta:
        return TransferMeta(SPEC, "r", self.keys)

    def views(self, layer: int) -> list[memoryview]:
        return peers.layer_views(self.src, SPEC, layer)

    def mine_unchanged(self) -> bool:
        """Every block still COMMITTED by prefill, and nothing but their registration (and a
        transfer that came back) in the history."""
        return all(self.mine.owner_of(k) == PREFILL and self.mine.state_of(k) is BlockState.COMMITTED
                   for k in self.keys)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def _moves(ledger: Ledger, move: Move) -> list[tuple[bytes, str, str, str | None]]:
    return [(r.key, str(r.owner_from), str(r.owner_to), r.tid) for r in ledger.history if r.move is move]


def test_a_commit_is_handed_off_by_the_sender_and_acquired_by_the_receiver() -> None:
    p = Pair()
    h = p.tx.send(p.meta(), p.views)
    inc = p.rx.next_transfer(5)
    assert h.state.value == "committed" and h.peer_owner == str(DECODE) and h.ledger_tid
    assert inc.peer == PREFILL and inc.ledger_tid == h.ledger_tid
    assert not any(p.mine.knows(k) for k in p.keys)  # HANDED_OFF is terminal: they left prefill's ledger
    assert _moves(p.mine, Move.HANDED_OFF) == [(k, f"transfer:{h.ledger_tid}", str(DECODE), h.ledger_tid)
                                               for k in p.keys]
    assert _moves(p.theirs, Move.ACQUIRE) == [(k, str(PREFILL), str(DECODE), h.ledger_tid) for k in p.keys]
    assert all(p.theirs.owner_of(k) == DECODE and p.theirs.state_of(k) is BlockState.COMMITTED for k in p.keys)
    assert p.theirs.record(p.keys[0]).origin == PREFILL
    assert np.array_equal(p.dst, p.src)
    p.close()


def test_the_blocks_belong_to_the_transfer_from_accept_to_commit() -> None:
    p = Pair()
    h = p.tx.begin(p.meta())
    assert all(p.mine.state_of(k) is BlockState.IN_TRANSFER for k in p.keys)  # before any LAYER frame
    assert p.mine.transfer(h.ledger_tid) is not None
    p.tx.abort(h, "changed my mind")
    assert p.mine_unchanged()
    with pytest.raises(TransferError, match="changed my mind"):
        p.rx.next_transfer(5).wait(5)
    assert not any(p.theirs.knows(k) for k in p.keys)
    p.close()


def test_a_sender_the_receiver_does_not_know_is_refused() -> None:
    p = Pair(receiver_peers=())
    with pytest.raises(UnknownPeerError, match="peer: "):
        p.tx.send(p.meta(), p.views)
    assert isinstance(p.rx.refusals[-1], UnknownPeerError)
    assert p.mine_unchanged() and not _moves(p.mine, Move.BEGIN_TRANSFER)  # refused before ACCEPT
    assert len(p.theirs) == 0 and not p.dst.any()
    p.close()


@pytest.mark.parametrize("sender_peer", [DECODE, None], ids=["named-peer", "ledger-peers"])
def test_a_receiver_the_sender_does_not_know_is_refused(sender_peer: Owner | None) -> None:
    """The receiver accepts as someone else: the sender aborts before any LAYER frame."""
    p = Pair(sender_peer=sender_peer, receiver_owner=Owner.engine("intruder"))
    with pytest.raises(UnknownPeerError, match="intruder"):
        p.tx.send(p.meta(), p.views)
    assert p.mine_unchanged() and not _moves(p.mine, Move.BEGIN_TRANSFER)
    inc = p.rx.next_transfer(5)
    with pytest.raises(UnknownPeerError):  # the sender's abort, typed
        inc.wait(5)
    assert inc.dest.state.value == "aborted" and not p.dst.any()  # type: ignore[attr-defined]
    assert len(p.theirs) == 0
    p.close()


def test_a_receiver_without_a_ledger_is_not_a_peer() -> None:
    p = Pair(receiver_ledger=False)
    with pytest.raises(UnknownPeerError, match="''"):
        p.tx.send(p.meta(), p.views)
    assert p.mine_unchanged()
    p.close()


def test_a_second_owner_is_refused_at_begin() -> None:
    p = Pair()
    p.theirs.register(p.keys[3], Owner.engine("decode-2"))  # another owner on the receiving side
    with pytest.raises(IllegalMoveError, match="second owner"):
        p.tx.send(p.meta(), p.views)
    assert p.mine_unchanged()
    assert len(p.theirs) == 1 and p.theirs.knows(p.keys[3]) and not p.dst.any()
    p.close()


def test_blocks_the_receiver_already_holds_stay_its_own_and_the_rest_are_acquired() -> None:
    """Two requests of one engine share a prefix (the key names the bytes): a transfer that brings
    a block the receiving engine already holds commits; that block keeps its record, the others are
    acquired with the transfer id."""
    p = Pair()
    p.theirs.register(p.keys[3], DECODE)
    p.tx.send(p.meta(), p.views)
    assert all(p.theirs.owner_of(k) == DECODE for k in p.keys)
    acquired = _moves(p.theirs, Move.ACQUIRE)
    assert len(acquired) == N - 1 and p.keys[3] not in {k for k, *_ in acquired}
    assert len(_moves(p.mine, Move.HANDED_OFF)) == N  # the sender gave every block up
    p.close()


def test_a_second_owner_at_the_commit_aborts_and_the_sender_gets_its_blocks_back() -> None:
    p = Pair()
    h = p.tx.begin(p.meta())
    for layer in range(SPEC.num_layers):
        p.tx.send_layer(h, layer, p.views(layer))
    inc = p.rx.next_transfer(5)
    p.theirs.register(p.keys[5], Owner.engine("decode-2"))  # someone else took a block meanwhile
    with pytest.raises(IllegalMoveError, match="already has owner"):
        p.tx.end(h)
    with pytest.raises(IllegalMoveError):
        inc.wait(5)
    assert p.mine_unchanged() and len(_moves(p.mine, Move.ABORT_TRANSFER)) == N  # given back
    assert inc.dest.state.value == "aborted" and inc.dest.linked == []  # type: ignore[attr-defined]
    assert len(p.theirs) == 1 and p.theirs.knows(p.keys[5])
    assert not _moves(p.theirs, Move.ACQUIRE)  # all or nothing
    assert p.rx.pool.in_use == 0
    p.close()


class _FailingCommit(BlockTableDestination):
    def commit(self) -> None:
        raise TierFullError("the tier filled up")


def test_a_destination_that_cannot_commit_forgets_the_acquired_blocks() -> None:
    p = Pair(dest=_FailingCommit)
    with pytest.raises(TransferError, match="commit failed"):
        p.tx.send(p.meta(), p.views)
    assert p.mine_unchanged()
    assert len(p.theirs) == 0  # acquired, then forgotten: nothing owned that was never linked
    assert [r.move for r in p.theirs.history] == [Move.ACQUIRE] * N + [Move.FORGET] * N
    p.close()


def test_without_ledgers_owners_are_empty_and_nothing_is_recorded() -> None:
    a, b = inproc.pair()
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    rx = Receiver(b, SPEC, lambda m: BlockTableDestination(dst, range(N), m), budget_bytes=1 << 20)
    rx.start()
    tx = Sender(a)
    h = tx.send(TransferMeta(SPEC, "r", peers.keys()), lambda layer: peers.layer_views(peers.source(), SPEC, layer))
    inc = rx.next_transfer(5)
    assert h.state.value == "committed" and h.peer_owner == "" and inc.peer is None
    tx.close()
    rx.close()
