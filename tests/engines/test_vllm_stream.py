"""The streamed hand-off (kvport.engines.vllm.stream) over real loopback sockets: a producer's paged KV,
layer by layer, into a decode engine's inbox, then into its paged KV through AsyncLoads; and every way
it can go wrong ending in blocks from the store or recomputed, never in KV the request did not name."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvport.client.port import StoreConfig, open_store
from kvport.codec.envelope import block_format, stored_bytes
from kvport.deadline import Deadline
from kvport.engines.vllm.paged import PagedKV
from kvport.engines.vllm.params import new_stream_id, parse_dest
from kvport.engines.vllm.plan import BlockCopy, ScheduledRequest, StepPlanner, StreamCopy
from kvport.engines.vllm.stream import Inbox, InboxServer, StreamOut
from kvport.engines.vllm.worker import AsyncLoads, BlockMover
from kvport.keys import KeyContext, chain_keys
from kvport.spec import DType, KVSpec, Layout
from kvport.transfer import nixl
from tests.waits import until

SPEC = KVSpec("m", num_layers=3, num_kv_heads=2, head_dim=8, dtype=DType.FP32, block_size=4, layout=Layout.VLLM_CPU)
CTX = KeyContext(block_size=4, spec_fingerprint=SPEC.fingerprint)
HEADER = block_format(SPEC).header_len
SECRET = b"a-deployment-secret-of-32-bytes!"  # every inbox link authenticates (kvport.transfer.links)


def producer(paged: PagedKV, *dests: str, spec: KVSpec = SPEC, **kw: Any) -> StreamOut:
    """A producer worker's StreamOut allowed to stream to ``dests`` (its deployment's inboxes)."""
    return StreamOut(spec, paged, SECRET, dests, **kw)


def engine_kv(num_blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn(num_blocks, 2, 4, 16, generator=g)) if seed is not None else (
        lambda: torch.zeros(num_blocks, 2, 4, 16))
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(3)}


@pytest.fixture(params=["tcp", "shm", pytest.param("nixl", marks=pytest.mark.skipif(
    nixl.available() is not None, reason=f"{nixl.available()}"))])
def inbox(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Inbox, InboxServer]]:
    """A decode engine's inbox on loopback TCP, on shared memory (producers on this host), and over
    NIXL (the stream's bytes written by NIXL into the inbox link's ring; UCX as it picks here; every
    send through NIXL, even this small model's, none inside the control messages)."""
    if request.param == "nixl":
        monkeypatch.setattr(nixl.NixlRingTransport, "inline_below", 0)
    box = Inbox(SPEC, 8, HEADER, ttl_s=30.0)
    address = {"tcp": "127.0.0.1:0", "shm": f"shm:kvport-test-{new_stream_id()[:12]}",
               "nixl": "nixl:127.0.0.1:0"}[request.param]
    srv = InboxServer(box, address, SECRET)
    yield box, srv
    srv.close()


def stream_all(out: StreamOut, copies: list[StreamCopy]) -> list[StreamCopy]:
    """Stream ``copies`` as a step would; the ones that failed (every other one committed)."""
    out.begin(copies)
    for layer in range(SPEC.num_layers):
        out.layer(layer)
    committed, failed = out.finish()
    assert sorted(id(c) for c in committed + failed) == sorted(id(c) for c in copies)
    return failed


def copy_of(n: int, ids: list[int], req: str = "r") -> BlockCopy:
    keys = chain_keys(list(range(n * 4)), CTX)
    return BlockCopy(req, tuple(keys), tuple(ids))


def test_stream_lands_every_layer_and_only_the_named_stream_is_taken(inbox: tuple[Inbox, InboxServer]) -> None:
    box, srv = inbox
    src = PagedKV(engine_kv(16, seed=1), SPEC)
    out = producer(src, srv.address)
    sid = new_stream_id()
    c = copy_of(3, [9, 2, 14])
    assert stream_all(out, [StreamCopy(sid, srv.address, c, 0)]) == []
    # another stream id, same keys: nothing (the request only links what its own stream brought)
    slots, why = box.take(new_stream_id(), c.keys, Deadline.after(1.0), unknown_wait_s=0.05)
    assert slots == [] and "never reached" in why
    slots, why = box.take(sid, c.keys, Deadline.after(1.0))
    assert why == "" and len(slots) == 3
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(box.layer(layer, box.rows(slots)), src.arrays[layer][[9, 2, 14]])
    box.release(slots)
    assert box.free_blocks == box.capacity
    out.close()


def test_async_load_takes_the_stream_and_keeps_it_after_the_first_step(tmp_path: Path,
                                                                       inbox: tuple[Inbox, InboxServer]) -> None:
    box, srv = inbox
    src_kv, dst_kv = engine_kv(16, seed=2), engine_kv(16, seed=None)
    out = producer(PagedKV(src_kv, SPEC), srv.address)
    sid = new_stream_id()
    keys = chain_keys(list(range(20)), CTX)  # 5 blocks: 2 streamed, the 3rd only in the store, 4-5 nowhere
    c = BlockCopy("r", tuple(keys[:2]), (3, 7))
    assert stream_all(out, [StreamCopy(sid, srv.address, c, 0)]) == []
    st = open_store(StoreConfig(block_bytes=stored_bytes(SPEC), disk_dir=tmp_path / "d", disk_bytes=1 << 30))
    BlockMover(SPEC, st, PagedKV(src_kv, SPEC), 2).save([BlockCopy("p", (keys[2],), (11,), keys[1])])
    loads = AsyncLoads(SPEC, st, PagedKV(dst_kv, SPEC), 4, inbox=box)
    try:
        loads.submit([BlockCopy("r", tuple(keys), (0, 1, 2, 5, 6), None, sid)])
        done: set[str] = set()
        failed: set[int] = set()

        def ended() -> bool:
            d, f = loads.take()
            done.update(d)
            failed.update(f)
            return "r" in done

        until(ended, "the stream never ended", 10.0, 0.01)
        assert failed == {5, 6}  # not streamed, not stored: vLLM recomputes them
        for name in src_kv:
            assert torch.equal(dst_kv[name][[0, 1, 2]], src_kv[name][[3, 7, 11]])
        # the streamed blocks wait in the inbox until the request's first step ran, then go to the store
        time.sleep(0.1)
        assert box.free_blocks == box.capacity - 2 and st.contains_many(keys[:2]) == [False, False]
        loads.keep(["r"])
        until(lambda: box.free_blocks == box.capacity, "the inbox never got its blocks back", 10.0, 0.01)
        assert st.contains_many(keys[:3]) == [True, True, True]  # the next turn's prefill finds them
        fmt = block_format(SPEC)  # sealed: a stored block that opens under its key
        buf = memoryview(bytearray(fmt.value_bytes))
        assert st.get_many_into([(keys[0], buf)]) == [fmt.value_bytes]
        fmt.open(buf, keys[0])
    finally:
        loads.close()
        out.close()


def test_a_synchronous_take_copies_a_committed_stream_at_once_and_never_waits_for_a_missing_one(
        tmp_path: Path, inbox: tuple[Inbox, InboxServer]) -> None:
    """kvport_pd_take "sync": the hand-off is taken in the request's first step, before its forward. A
    committed stream is copied at once; a stream that never came costs the step at most
    SYNC_TAKE_WAIT_S and its blocks are recomputed (never a partial link of them from elsewhere)."""
    from kvport.engines.vllm.worker import SYNC_TAKE_WAIT_S

    box, srv = inbox
    src_kv, dst_kv = engine_kv(16, seed=6), engine_kv(16, seed=None)
    out = producer(PagedKV(src_kv, SPEC), srv.address)
    sid = new_stream_id()
    keys = chain_keys(list(range(12)), CTX)
    assert stream_all(out, [StreamCopy(sid, srv.address, BlockCopy("r", tuple(keys), (4, 8, 12)), 0)]) == []
    st = open_store(StoreConfig(block_bytes=stored_bytes(SPEC), disk_dir=tmp_path / "d", disk_bytes=1 << 30))
    loads = AsyncLoads(SPEC, st, PagedKV(dst_kv, SPEC), 4, inbox=box)
    try:
        assert loads.load_now([BlockCopy("r", tuple(keys), (0, 1, 2), None, sid)]) == []
        for name in src_kv:
            assert torch.equal(dst_kv[name][[0, 1, 2]], src_kv[name][[4, 8, 12]])
        loads.keep(["r"])  # the first step ran: kept in the store, the inbox freed
        until(lambda: box.free_blocks == box.capacity, "the inbox never got its blocks back", 10.0, 0.01)
        t0 = time.monotonic()
        other = chain_keys(list(range(100, 108)), CTX)
        assert loads.load_now([BlockCopy("s", tuple(other), (5, 6), None, new_stream_id())]) == [5, 6]
        assert time.monotonic() - t0 < 1.0 and SYNC_TAKE_WAIT_S < 1.0  # not the async path's 1 s wait
        assert torch.count_nonzero(dst_kv[next(iter(dst_kv))][[5, 6]]) == 0  # nothing linked
    finally:
        loads.close()
        out.close()


def test_a_stream_nobody_takes_goes_to_the_store_when_its_room_is_needed(tmp_path: Path) -> None:
    box = Inbox(SPEC, 2, HEADER, ttl_s=0.0)
    srv = InboxServer(box, "127.0.0.1:0", SECRET)
    st = open_store(StoreConfig(block_bytes=stored_bytes(SPEC), disk_dir=tmp_path / "d", disk_bytes=1 << 30))
    loads = AsyncLoads(SPEC, st, PagedKV(engine_kv(4, seed=None), SPEC), 2, inbox=box)  # its keeper keeps lapsed ones
    out = producer(PagedKV(engine_kv(8, seed=5), SPEC), srv.address)
    try:
        first = StreamCopy(new_stream_id(), srv.address, copy_of(2, [0, 1]), 0)
        assert stream_all(out, [first]) == []
        second = StreamCopy(new_stream_id(), srv.address, copy_of(2, [2, 3], "s"), 0)
        assert stream_all(out, [second]) == [second]  # no room yet: refused, the producer saves it itself
        until(lambda: all(st.contains_many(first.copy.keys)), "the lapsed stream was not kept in the store", 10.0, 0.01)
        until(lambda: box.free_blocks == 2, "the inbox never freed all but 2 blocks", 10.0, 0.01)
        slots, why = box.take(second.stream, second.copy.keys, Deadline.after(5.0))
        assert slots == [] and "free blocks" in why  # refused streams answer at once, no wait
        third = StreamCopy(new_stream_id(), srv.address, copy_of(2, [4, 5], "t"), 0)
        assert stream_all(out, [third]) == []
    finally:
        out.close()
        loads.close()
        srv.close()


def test_incompatible_full_or_dead_inbox_falls_back_to_the_store(inbox: tuple[Inbox, InboxServer]) -> None:
    box, srv = inbox
    paged = PagedKV(engine_kv(16, seed=3), SPEC)
    # another dtype: refused at TRANSFER_BEGIN with the field named, before any byte
    other = dataclasses.replace(SPEC, dtype=DType.FP16)
    sc = StreamCopy(new_stream_id(), srv.address, copy_of(2, [1, 2]), 0)
    out = producer(paged, srv.address, spec=other)
    assert stream_all(out, [sc]) == [sc]
    until(lambda: any("dtype" in str(e) for e in srv.refusals()), "the mismatched dtype was never refused", 10.0, 0.01)
    # more blocks than the inbox holds: refused whole (bounded memory), saved the old way
    big = StreamCopy(new_stream_id(), srv.address, copy_of(9, list(range(9))), 0)
    out = producer(paged, srv.address, "127.0.0.1:1")
    assert stream_all(out, [big]) == [big]
    assert box.free_blocks == box.capacity
    # nobody listening
    gone = StreamCopy(new_stream_id(), "127.0.0.1:1", copy_of(1, [4]), 0)
    assert stream_all(out, [gone]) == [gone]
    slots, why = box.take(gone.stream, gone.copy.keys, Deadline.after(1.0), unknown_wait_s=0.05)
    assert slots == [] and why
    out.close()


def test_a_stream_cut_mid_transfer_links_nothing(inbox: tuple[Inbox, InboxServer]) -> None:
    box, srv = inbox
    out = producer(PagedKV(engine_kv(16, seed=4), SPEC), srv.address, tail_s=1.0)
    sc = StreamCopy(new_stream_id(), srv.address, copy_of(2, [5, 6]), 0)
    out.begin([sc])
    out.layer(0)  # the producer dies after one layer
    time.sleep(0.2)
    for o in out._open:
        o.sender.close()
    t0 = time.monotonic()
    slots, why = box.take(sc.stream, sc.copy.keys, Deadline.after(5.0))
    assert slots == [] and "aborted" in why
    assert time.monotonic() - t0 < 4  # the abort ends the wait, not the deadline
    assert box.free_blocks == box.capacity


def test_planner_streams_every_prompt_block_once_and_saves_none_of_them() -> None:
    held: set[bytes] = set()
    p = StepPlanner(CTX, lambda k: k in held)
    prompt = list(range(18))  # 4 full blocks and 2 tokens
    assert p.lookup("r", prompt, 0) == 0
    sid = new_stream_id()
    p.stream_to("r", sid, "127.0.0.1:9")
    p.after_alloc("r", 0)
    a = p.step([ScheduledRequest("r", 0, 10, [7, 8, 9], True)])  # chunked: 2 full blocks computed
    b = p.step([ScheduledRequest("r", 10, 8, [10, 11], False)])
    assert [s.copy.block_ids for s in a.streams] == [(7, 8)] and [s.first_block for s in a.streams] == [0]
    assert [s.copy.block_ids for s in b.streams] == [(9, 10)] and b.streams[0].first_block == 2
    assert b.streams[0].copy.parent == a.streams[0].copy.keys[-1]
    assert a.saves == () and b.saves == ()
    assert p.streamed("r") == sid
    # the decode side: a hand-off named by its stream loads from there
    q = StepPlanner(CTX, lambda k: False)
    assert q.lookup("d", prompt, 0) == 0
    q.expect_stream("d", 16, sid)
    q.after_alloc("d", 16, [0, 1, 2, 3, 4])
    (load,) = q.step([]).async_loads
    assert load.stream == sid and load.block_ids == (0, 1, 2, 3)
    # its first step: the worker keeps the streamed blocks in the store after it (once)
    assert q.step([ScheduledRequest("d", 16, 2, [0, 1, 2, 3, 4], True)]).kept == ("d",)
    assert q.step([ScheduledRequest("d", 18, 1, None, False)]).kept == ()
    # taken in the request's first step instead (kvport_pd_take "sync"): a load of that step naming the
    # stream, kept in the store after it
    sid2 = new_stream_id()
    assert q.lookup("e", prompt, 0, probe=False) == 0
    q.expect_stream("e", 16, sid2)
    assert q.stream_of("e") == sid2
    q.after_alloc("e", 16)
    first = q.step([ScheduledRequest("e", 16, 2, [5, 6, 7, 8, 9], True)])
    (load,) = first.loads
    assert load.stream == sid2 and load.block_ids == (5, 6, 7, 8) and first.async_loads == ()
    assert first.kept == ("e",)


def test_parse_dest() -> None:
    assert parse_dest("127.0.0.1:9300") == "127.0.0.1:9300"
    assert parse_dest("shm:kvport-inbox-1") == "shm:kvport-inbox-1"
    assert parse_dest("nixl:10.0.0.2:9300") == "nixl:10.0.0.2:9300"
    for bad in (None, 7, "host", "h:0", "h:99999", ":80", "x" * 400, "shm:", "shm:a/b", "shm:" + "x" * 101,
                "nixl:", "nixl:h", "nixl:h:0", "nixl:shm:a", "nixl:nixl:h:1"):
        assert parse_dest(bad) is None


def test_stream_config_keys_and_the_proxy_s_inboxes() -> None:
    from kvport.engines.vllm.config import ConnectorConfig
    from kvport.errors import ConfigError
    from kvport.proxy.service import ProxyConfig

    cfg = ConnectorConfig.from_extra_config({"kvport_server": "h:1", "kvport_pd_inbox": "127.0.0.1:9200",
                                             "kvport_pd_inbox_tokens": 4096})
    assert cfg.pd_inbox == "127.0.0.1:9200" and cfg.pd_inbox_tokens == 4096 and cfg.pd_stream
    assert ConnectorConfig.from_extra_config({"kvport_server": "h:1", "kvport_pd_inbox": "shm:inbox-1"}).pd_inbox \
        == "shm:inbox-1"
    assert ConnectorConfig.from_extra_config({"kvport_server": "h:1"}).pd_inbox is None
    assert cfg.pd_take == "sync"  # a streamed hand-off is taken in the request's first step by default
    assert ConnectorConfig.from_extra_config({"kvport_server": "h:1", "kvport_pd_take": "async"}).pd_take == "async"
    h = {"kvport_server": "h:1"}
    for bad in ({**h, "kvport_pd_inbox": "nohost"}, {**h, "kvport_pd_inbox": "shm:a b"},
                {**h, "kvport_pd_inbox_tokens": 0},
                {**h, "kvport_pd_inbox_tokens": True}, {**h, "kvport_pd_stream": "yes"},
                {**h, "kvport_pd_inbox": "127.0.0.1:9", "kvport_async_handoff": False},
                {**h, "kvport_pd_take": "later"}, {**h, "kvport_pd_take": True}):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra_config(bad)
    ok = ProxyConfig(prefill=["http://a:1"], decode=["http://b:2", "http://c:3"], decode_inbox=["b:9", "c:9"])
    assert list(ok.decode_inbox) == ["b:9", "c:9"]
    for inboxes in (["b:9"], ["b:9", "c"]):  # one per decode engine, each HOST:PORT
        with pytest.raises(ConfigError):
            ProxyConfig(prefill=["http://a:1"], decode=["http://b:2", "http://c:3"], decode_inbox=inboxes)


def test_a_block_corrupted_in_flight_is_never_linked(inbox: tuple[Inbox, InboxServer],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault the real link does not produce on demand: one byte of a block-layer flipped after the
    sender hashed it. The inbox refuses the whole transfer; the producer saves the blocks itself."""
    from kvport.transfer import tcp

    box, srv = inbox
    if srv.address.startswith("shm:"):
        pytest.skip("the fault is injected into the TCP and NIXL transports")
    if srv.address.startswith("nixl:"):  # a byte flipped in the sender's ring before NIXL writes it
        push = nixl.NixlRingTransport._push
        flips = [0]

        def corrupt_push(self: Any, pos: int, n: int) -> None:
            if not flips[0] and n > SPEC.bytes_per_layer_block:
                self._out_mv[pos + n - 9] ^= 0x40  # the frame's last chunk, before its checksum
                flips[0] += 1
            push(self, pos, n)

        monkeypatch.setattr(nixl.NixlRingTransport, "_push", corrupt_push)
    real = tcp.connect

    def corrupting(*args: Any, **kw: Any) -> Any:
        t = real(*args, **kw)
        send = t.send
        flipped = [False]

        def bad_send(parts: list[memoryview]) -> None:
            parts = list(parts)
            for i, p in enumerate(parts):
                if not flipped[0] and memoryview(p).nbytes == SPEC.bytes_per_layer_block:
                    b = bytearray(p)
                    b[7] ^= 0x40
                    parts[i] = memoryview(b)
                    flipped[0] = True
            send(parts)

        t.send = bad_send  # type: ignore[method-assign,assignment]
        return t

    monkeypatch.setattr(tcp, "connect", corrupting)
    out = producer(PagedKV(engine_kv(16, seed=6), SPEC), srv.address)
    sc = StreamCopy(new_stream_id(), srv.address, copy_of(3, [1, 2, 3]), 0)
    assert stream_all(out, [sc]) == [sc]  # not committed: saved to the store by the producer instead
    slots, why = box.take(sc.stream, sc.copy.keys, Deadline.after(2.0))
    assert slots == [] and why and box.free_blocks == box.capacity
    out.close()


def test_the_inbox_tracks_a_bounded_number_of_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transfers begun and aborted under ids nobody asks for (a local peer probing the inbox) leave
    their reason behind, not their slots; the inbox keeps at most MAX_STREAMS of them."""
    from kvport.engines.vllm import stream as stream_mod
    from kvport.errors import TierFullError, TransferError
    from kvport.protocol.transfer import TransferMeta

    monkeypatch.setattr(stream_mod, "MAX_STREAMS", 8)
    box = Inbox(SPEC, 4, HEADER, ttl_s=3600.0)
    keys = tuple(bytes(k) for k in chain_keys(list(range(4)), CTX))
    for _ in range(8):
        box.destination(TransferMeta(SPEC, new_stream_id(), keys)).abort()
    assert box.free_blocks == 4
    with pytest.raises(TierFullError, match="streams nobody took"):
        box.destination(TransferMeta(SPEC, new_stream_id(), keys))
    with pytest.raises(TransferError, match="names its stream"):  # an id that is not a stream id: refused
        box.destination(TransferMeta(SPEC, "not-a-stream", keys))
