"""Ownership on the vLLM hand-off (issue 26): a streamed hand-off is recorded in both engines' ledgers
with one transfer id -- the producer's blocks HANDED_OFF to the decode engine, the decode engine's
ACQUIRE from the producer -- and the decode engine's records end with the blocks: handed to the pool
when the keeper put them in the store, forgotten when nobody used them. Neither ledger keeps a block
after its hand-off settled (no leak), also when a stream fails or two streams carry one block."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvport.client.port import StoreConfig, open_store
from kvport.codec.envelope import stored_bytes
from kvport.deadline import Deadline
from kvport.engines.vllm.paged import PagedKV
from kvport.engines.vllm.params import new_stream_id
from kvport.engines.vllm.plan import BlockCopy, StreamCopy
from kvport.engines.vllm.stream import Inbox, InboxServer, StreamOut
from kvport.engines.vllm.worker import AsyncLoads
from kvport.keys import chain_keys
from kvport.ledger import Ledger, Move, Owner
from kvport.transfer.handoff import MAX_PEERS, engine_owner
from tests.waits import until

from .test_vllm_stream import CTX, HEADER, SECRET, SPEC, engine_kv, stream_all

PREFILL, DECODE = engine_owner("prefill", "p0"), engine_owner("decode", "d0")


@pytest.fixture(params=["tcp", "shm"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[StreamOut, Inbox, InboxServer]]:
    """A producer and a decode engine, each with its own ledger, over loopback TCP or shared memory."""
    box = Inbox(SPEC, 8, HEADER, ttl_s=30.0, ledger=Ledger(owners=[DECODE]), owner=DECODE)
    addr = "127.0.0.1:0" if request.param == "tcp" else f"shm:kvport-test-{new_stream_id()[:12]}"
    srv = InboxServer(box, addr, SECRET)
    out = StreamOut(SPEC, PagedKV(engine_kv(16, seed=3), SPEC), SECRET, [srv.address],
                    ledger=Ledger(owners=[PREFILL]), owner=PREFILL)
    yield out, box, srv
    out.close()
    srv.close()


def moves(led: Ledger, key: bytes) -> list[tuple[Move, Owner | None, Owner | None, str | None]]:
    return [(r.move, r.owner_from, r.owner_to, r.tid) for r in led.history if r.key == key]


def test_a_streamed_hand_off_is_recorded_in_both_ledgers_with_one_transfer_id(
        tmp_path: Path, engines: tuple[StreamOut, Inbox, InboxServer]) -> None:
    out, box, srv = engines
    assert out.ledger is not None and box.ledger is not None
    keys = chain_keys(list(range(12)), CTX)  # 3 blocks, all streamed
    sid = new_stream_id()
    assert stream_all(out, [StreamCopy(sid, srv.address, BlockCopy("r", tuple(keys), (3, 7, 9)), 0)]) == []
    sent = moves(out.ledger, bytes(keys[0]))
    assert [m for m, *_ in sent] == [Move.REGISTER, Move.COMMIT, Move.BEGIN_TRANSFER, Move.HANDED_OFF]
    tid = sent[-1][3]
    assert tid and sent[-1][2] == DECODE  # handed to the decode engine, by the name it accepted as
    assert len(out.ledger) == 0  # the blocks left the producer's ledger with the commit
    for k in keys:
        got = moves(box.ledger, bytes(k))
        assert got == [(Move.ACQUIRE, PREFILL, DECODE, tid)], got
        rec = box.ledger.record(bytes(k))
        assert rec.owner == DECODE and rec.origin == PREFILL  # from whom
    st = open_store(StoreConfig(block_bytes=stored_bytes(SPEC), disk_dir=tmp_path / "d", disk_bytes=1 << 30))
    loads = AsyncLoads(SPEC, st, PagedKV(engine_kv(16, seed=None), SPEC), 4, inbox=box)
    try:
        loads.submit([BlockCopy("r", tuple(keys), (0, 1, 2), None, sid)])
        until(lambda: "r" in loads.take()[0], "the load never ended", 10.0, 0.01)
        assert len(box.ledger) == 3  # the request holds them until its first step ran
        loads.keep(["r"])
        until(lambda: box.free_blocks == box.capacity, "the inbox never got its blocks back", 10.0, 0.01)
    finally:
        loads.close()
    assert st.contains_many(keys) == [True] * 3
    for k in keys:  # kept in the store: handed to the pool, recorded, and the engine holds nothing more
        assert [m for m, *_ in moves(box.ledger, bytes(k))] == [Move.ACQUIRE, Move.SHARE, Move.FORGET]
    assert len(box.ledger) == 0


def test_a_failed_stream_leaves_no_record_on_either_side(engines: tuple[StreamOut, Inbox, InboxServer]) -> None:
    out, box, srv = engines
    assert out.ledger is not None and box.ledger is not None
    keys = chain_keys(list(range(8)), CTX)
    box.discard(sid := new_stream_id())  # a spent id: the inbox refuses the transfer
    assert stream_all(out, [StreamCopy(sid, srv.address, BlockCopy("r", tuple(keys), (1, 2)), 0)]) != []
    assert len(out.ledger) == 0 and len(box.ledger) == 0
    assert [m for m, *_ in moves(out.ledger, bytes(keys[0]))] == [Move.REGISTER, Move.COMMIT, Move.FORGET]


def test_a_block_two_streams_carry_is_recorded_once_and_leaves_with_its_last_slot(
        engines: tuple[StreamOut, Inbox, InboxServer]) -> None:
    """A prefix two requests share: one ACQUIRE (the second transfer finds it the engine's already),
    and the record stays until no slot holds the block."""
    out, box, srv = engines
    assert box.ledger is not None
    keys = chain_keys(list(range(8)), CTX)
    a, b = new_stream_id(), new_stream_id()
    for sid, req in ((a, "ra"), (b, "rb")):
        assert stream_all(out, [StreamCopy(sid, srv.address, BlockCopy(req, tuple(keys), (4, 5)), 0)]) == []
    assert [m for m, *_ in moves(box.ledger, bytes(keys[0]))] == [Move.ACQUIRE]
    assert box.discard(a) == 2
    assert len(box.ledger) == 2  # stream b still holds them
    slots, why = box.take(b, list(keys), Deadline.after(1.0))
    assert why == "" and len(slots) == 2 and len(box.ledger) == 2
    box.release(slots)  # not kept (the request failed): forgotten, never handed to the pool
    assert [m for m, *_ in moves(box.ledger, bytes(keys[0]))] == [Move.ACQUIRE, Move.FORGET]
    assert len(box.ledger) == 0 and box.free_blocks == box.capacity


def test_a_lapsed_stream_goes_to_the_pool_recorded(tmp_path: Path) -> None:
    box = Inbox(SPEC, 2, HEADER, ttl_s=0.0, ledger=Ledger(owners=[DECODE]), owner=DECODE)
    assert box.ledger is not None
    srv = InboxServer(box, "127.0.0.1:0", SECRET)
    out = StreamOut(SPEC, PagedKV(engine_kv(16, seed=4), SPEC), SECRET, [srv.address],
                    ledger=Ledger(owners=[PREFILL]), owner=PREFILL)
    st = open_store(StoreConfig(block_bytes=stored_bytes(SPEC), disk_dir=tmp_path / "d", disk_bytes=1 << 30))
    loads = AsyncLoads(SPEC, st, PagedKV(engine_kv(16, seed=None), SPEC), 4, inbox=box)  # the keeper
    try:
        first, second = chain_keys(list(range(8)), CTX), chain_keys(list(range(100, 108)), CTX)
        one = StreamCopy(new_stream_id(), srv.address, BlockCopy("r", tuple(first), (1, 2)), 0)
        assert stream_all(out, [one]) == []
        # the second needs the first's room: refused now (saved by the producer), the first lapses into the store
        sc = StreamCopy(new_stream_id(), srv.address, BlockCopy("s", tuple(second), (3, 4)), 0)
        assert stream_all(out, [sc]) == [sc]
        until(lambda: st.contains_many(first) == [True, True] and box.free_blocks == 2,
              "the kept blocks never reached the store", 10.0, 0.01)
        for k in first:
            assert [m for m, *_ in moves(box.ledger, bytes(k))] == [Move.ACQUIRE, Move.SHARE, Move.FORGET]
        assert len(box.ledger) == 0 and not box.ledger.knows(bytes(second[0]))
        assert out.ledger is not None and len(out.ledger) == 0  # the refused transfer's blocks went back, forgotten
    finally:
        loads.close()
        out.close()
        srv.close()


def test_peers_admitted_over_authenticated_links_are_bounded() -> None:
    from kvport.transfer.handoff import AuthenticatedPeers

    led = Ledger()
    admit = AuthenticatedPeers(led, limit=2)
    assert admit(engine_owner("prefill", "a")) and admit(engine_owner("prefill", "b"))
    assert admit(engine_owner("prefill", "a"))  # known already
    assert not admit(engine_owner("prefill", "c"))  # a peer naming itself anew cannot grow the ledger
    assert not admit(Owner.pool()) and not admit(Owner.client("x"))  # only engines hand off
    assert len(led.peers) == 2 and MAX_PEERS >= 64


def test_the_decode_engine_s_hand_off_ledger_answers_who_handed_it_what(
        engines: tuple[StreamOut, Inbox, InboxServer], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``kvport inspect --handoff ADDR``: over the inbox's own authenticated link, the newest moves of the
    decode engine's ledger -- the blocks it acquired, from whom, how long ago, under the producer's
    transfer id; a caller without the deployment's secret gets nothing."""
    import json

    from kvport.cli.main import main
    from kvport.errors import AuthError
    from kvport.transfer.handoff import records

    out, _box, srv = engines
    keys = chain_keys(list(range(8)), CTX)
    assert stream_all(out, [StreamCopy(new_stream_id(), srv.address, BlockCopy("r", tuple(keys), (1, 2)), 0)]) == []
    assert out.ledger is not None
    tid = next(r.tid for r in out.ledger.history if r.move is Move.HANDED_OFF)
    ans = records(srv.address, SECRET)
    assert ans.owner == str(DECODE) and ans.held == 2
    assert [(r.key, r.move, r.owner_from, r.owner_to, r.tid) for r in ans.records] == \
        [(bytes(k).hex(), "acquire", str(PREFILL), str(DECODE), tid) for k in keys]
    assert all(0 <= r.age_s < 60 for r in ans.records)
    with pytest.raises(AuthError):
        records(srv.address, b"not-the-deployment-secret-at-all")
    monkeypatch.setenv("KVPORT_PD_SECRET", SECRET.decode())
    assert main(["inspect", "--handoff", srv.address, "--owners", bytes(keys[1]).hex()[:6], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["owner"] == str(DECODE) and [r["key"] for r in shown["records"]] == [bytes(keys[1]).hex()]


def test_two_requests_of_one_step_that_share_a_prefix_both_stream(
        engines: tuple[StreamOut, Inbox, InboxServer]) -> None:
    """Every prompt block goes to the decode engine under its request's stream, so a shared prefix is in
    two open transfers at once: the second is recorded in a ledger of its own and streams too (it used
    to fail on the engine's ledger, where a block is in one transfer at a time, and go to the store)."""
    out, box, srv = engines
    assert out.ledger is not None and box.ledger is not None
    shared = chain_keys(list(range(8)), CTX)
    a, b = new_stream_id(), new_stream_id()
    copies = [StreamCopy(a, srv.address, BlockCopy("ra", tuple(shared), (1, 2)), 0),
              StreamCopy(b, srv.address, BlockCopy("rb", tuple(shared), (1, 2)), 0)]
    assert stream_all(out, copies) == []  # both committed
    assert out.transfer_ledgers == 1 and len(out.ledger) == 0
    tids = {r.tid for r in out.ledger.history if r.move is Move.HANDED_OFF}
    assert len(tids) == 1  # the engine's ledger recorded the first; the second had its own
    for sid in (a, b):
        slots, why = box.take(sid, list(shared), Deadline.after(2.0))
        assert why == "" and len(slots) == 2
        box.release(slots)
    assert len(box.ledger) == 0 and box.free_blocks == box.capacity


def test_an_inbox_with_a_ledger_refuses_a_transfer_nobody_records(
        engines: tuple[StreamOut, Inbox, InboxServer]) -> None:
    """A sender that names no ledger owner (its hand-off would leave no record on its side) lands nothing,
    even with the deployment's secret."""
    from kvport.errors import UnknownPeerError
    from kvport.protocol.transfer import TransferMeta
    from kvport.transfer import links
    from kvport.transfer.sender import Sender

    _out, box, srv = engines
    s = Sender(links.dial(srv.address, SECRET))
    try:
        with pytest.raises(UnknownPeerError):
            s.begin(TransferMeta(SPEC, new_stream_id(), tuple(bytes(k) for k in chain_keys(list(range(8)), CTX))),
                    timeout_s=5.0)
    finally:
        s.close()
    assert box.free_blocks == box.capacity and box.ledger is not None and len(box.ledger) == 0
