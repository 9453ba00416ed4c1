"""KV over NIXL (kvport.transfer.nixl) between two real processes: the contract, the grant and the
checksums on kvport's control channel, the bytes by a NIXL WRITE (UCX on this CPU); every fault a
typed error on the sender, nothing linked on the receiver."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvport import memops
from kvport.errors import ChecksumError, IncompatibleSpecError, PeerError, TransferError
from kvport.protocol.frame import MsgType
from kvport.protocol.transfer import TransferMeta
from kvport.spec import DType, KVSpec, from_preset
from kvport.transfer import nixl

pytestmark = pytest.mark.skipif(nixl.available() is not None, reason=f"{nixl.available()}")

BLOCKS = 6


def _spec() -> KVSpec:
    return from_preset("llama-3.1-8b", block_size=16)


def _src(n: int = BLOCKS, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, _spec().bytes_per_block), dtype=np.uint8)


def _meta(spec: KVSpec, n: int = BLOCKS) -> TransferMeta:
    return TransferMeta(spec, "r-nixl", tuple(i.to_bytes(16, "little") for i in range(n)))


def _child(conn: Any, mode: str) -> None:  # the receiver process
    recv = nixl.NixlReceiver(_spec(), BLOCKS)
    if mode == "out_of_bounds":
        recv.tamper_addr = 1 << 40  # grants a region far outside what it registered
    if mode == "stale":  # grants with the metadata of an agent that is gone
        old = nixl._Agent("old", np.zeros(1 << 20, np.uint8))
        name, md = old.name, old.metadata()
        old.close()
        del old
        recv._agent.name, recv._agent.metadata = name, lambda: md  # type: ignore[method-assign]
    if mode == "die":  # dies right after its grant, before the write lands
        serve = recv._serve

        def dying(io: Any) -> Any:
            orig = io.send

            def send(t: MsgType, *a: Any, **k: Any) -> Any:
                out = orig(t, *a, **k)
                if t == MsgType.TRANSFER_ACCEPT:
                    os._exit(3)
                return out

            io.send = send
            return serve(io)

        recv._serve = dying  # type: ignore[method-assign]
    conn.send(recv.address)
    while conn.recv() == "go":
        try:
            got = recv.receive(timeout_s=30)
            conn.send(("ok", got.nbytes, memops.xxh3_many([recv.buf[i].data for i in range(got.meta.n_blocks)])))
        except TransferError as exc:
            conn.send(("error", type(exc).__name__, str(exc)))


class _Peer:
    def __init__(self, mode: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(there, mode), daemon=True)
        self.proc.start()
        self.host, self.port = self.conn.recv()

    def go(self) -> None:
        self.conn.send("go")

    def result(self) -> Any:
        try:
            return self.conn.recv() if self.conn.poll(30) else None
        except EOFError:  # it died (on purpose: the "die" peer)
            return None

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture()
def peer(request: pytest.FixtureRequest) -> Iterator[_Peer]:
    p = _Peer(getattr(request, "param", "ok"))
    yield p
    p.close()


def test_blocks_arrive_exact_and_verified_and_a_refused_contract_names_its_field(peer: _Peer) -> None:
    src = _src()
    with nixl.NixlSender(src) as s:
        for n in (BLOCKS, 2):  # twice over one agent pair (the peer's metadata added once)
            peer.go()
            assert s.send(peer.host, peer.port, _meta(_spec(), n)) == n * _spec().bytes_per_block
            status, nbytes, sums = peer.result()
            assert status == "ok" and nbytes == n * _spec().bytes_per_block
            assert sums == memops.xxh3_many([src[i].data for i in range(n)])
        other = replace(_spec(), dtype=DType.FP16)  # another dtype: refused before any byte moves
        peer.go()
        with pytest.raises(IncompatibleSpecError) as ei:
            s.send(peer.host, peer.port, _meta(other))
        assert ei.value.field == "dtype" and peer.result()[1] == "IncompatibleSpecError"
        big = _src(BLOCKS + 1)
        with nixl.NixlSender(big) as s2:  # more than the inbox's room: the grant is the credit
            peer.go()
            with pytest.raises(IncompatibleSpecError, match="capacity"):
                s2.send(peer.host, peer.port, _meta(_spec(), BLOCKS + 1))
            assert peer.result()[0] == "error"
        peer.go()  # wrong checksums from the producer: the receiver aborts, nothing linked
        bad = bytearray(memops.xxh3_many([src[i].data for i in range(BLOCKS)]))
        bad[8] ^= 1
        with pytest.raises(ChecksumError):
            s.send(peer.host, peer.port, _meta(_spec()), digests=bytes(bad))
        assert peer.result()[1] == "ChecksumError"


@pytest.mark.parametrize("peer", ["out_of_bounds", "stale", "die"], indirect=True)
def test_a_bad_grant_or_a_dead_peer_is_a_typed_error_within_the_deadline(peer: _Peer) -> None:
    with nixl.NixlSender(_src()) as s:
        peer.go()
        with pytest.raises(TransferError) as ei:
            s.send(peer.host, peer.port, _meta(_spec()), deadline_s=10)
        # NIXL refuses a descriptor outside the peer's registered memory (NIXL_ERR_NOT_FOUND) and
        # metadata of an agent that is gone or died (NIXL_ERR_BACKEND): the caller falls back
        assert isinstance(ei.value, PeerError) and "NIXL" in str(ei.value)
    got = peer.result()
    assert got is None or got[0] == "error"  # never "ok": nothing linked


# ------------------------------------------------------------------ nixl:HOST:PORT links (NixlRingTransport)
SECRET = b"a-link-secret-of-at-least-16-bytes"


def _duplex_data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _send_chunks(t: Any, data: np.ndarray) -> None:
    for lo in range(0, data.nbytes, 1 << 20):  # a NIXL write each: above the 64 KiB sent inline
        t.send([data.data[lo : lo + (1 << 20)]])


def _ring_child(conn: Any, mode: str) -> None:  # the listening side of a nixl: link
    from kvport.transfer import links

    ln = links.LinkListener("nixl:127.0.0.1:0", SECRET)
    conn.send(ln.address)
    t = ln.accept(20).authenticate()
    if mode == "die":  # reads the first bytes of a large send, then dies with the rest under way
        t.recv_into([memoryview(bytearray(1 << 20))])
        os._exit(3)
    n = conn.recv()
    buf = bytearray(n)
    if mode == "duplex":  # its own stream sent while it reads the peer's: one agent, two threads
        reader = threading.Thread(target=t.recv_into, args=([memoryview(buf)],))
        reader.start()
        _send_chunks(t, _duplex_data(n, 5))
        reader.join(60)
        conn.send(memops.xxh3_many([memoryview(buf)]))
        conn.recv()
        return
    t.recv_into([memoryview(buf)])
    t.send([buf])  # and back: the stream carries large sends both ways
    conn.send(memops.xxh3_many([memoryview(buf)]))
    conn.recv()


@pytest.fixture
def ring_peer() -> Iterator[Any]:
    ctx = mp.get_context("spawn")
    procs: list[Any] = []

    def start(mode: str) -> tuple[Any, str]:
        here, there = ctx.Pipe()
        p = ctx.Process(target=_ring_child, args=(there, mode), daemon=True)
        p.start()
        procs.append(p)
        return here, here.recv()

    yield start
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


def test_a_nixl_link_carries_the_stream_exact_both_ways(ring_peer: Any) -> None:
    from kvport.transfer import links

    conn, address = ring_peer("echo")
    assert address.startswith("nixl:127.0.0.1:")
    t = links.dial(address, SECRET, timeout_s=20)
    try:
        assert t.name == "nixl"
        data = np.random.default_rng(3).integers(0, 256, 40 << 20, dtype=np.uint8)  # ring laps, NIXL writes
        conn.send(data.nbytes)
        t.send([data.data[: 7 << 20], data.data[7 << 20 :]])
        back = bytearray(data.nbytes)
        t.recv_into([memoryview(back)])
        assert conn.recv() == memops.xxh3_many([data.data]) and bytes(back) == data.tobytes()
        conn.send("bye")
    finally:
        t.close()


def test_a_nixl_link_carries_two_streams_at_once_exact(ring_peer: Any) -> None:
    """Both sides send while they receive: each side's agent is posted to by its sending thread and
    progressed by its receiving thread at the same time (what a hand-off link does: blocks one way,
    credits and aborts the other). NIXL's unlocked default let the two corrupt the UCX worker."""
    from kvport.transfer import links

    conn, _address = ring_peer("duplex")
    t = links.dial(_address, SECRET, timeout_s=20)
    n = 48 << 20
    try:
        conn.send(n)
        back = bytearray(n)
        reader = threading.Thread(target=t.recv_into, args=([memoryview(back)],))
        reader.start()
        mine = _duplex_data(n, 4)
        _send_chunks(t, mine)
        reader.join(60)
        assert not reader.is_alive()
        assert conn.recv() == memops.xxh3_many([mine.data])
        assert bytes(back) == _duplex_data(n, 5).tobytes()
        conn.send("bye")
    finally:
        t.close()


def test_a_nixl_peer_that_dies_mid_stream_is_a_peer_error_not_a_hang(ring_peer: Any) -> None:
    from kvport.transfer import links

    _, address = ring_peer("die")
    t = links.dial(address, SECRET, timeout_s=5)
    try:
        with pytest.raises(PeerError):
            for _ in range(64):  # 32 MiB rings: the writes outrun what a dead reader frees
                t.send([np.zeros(4 << 20, np.uint8).data])
    finally:
        t.close()


def test_a_nixl_link_refuses_a_peer_without_the_secret(ring_peer: Any) -> None:
    from kvport.errors import AuthError
    from kvport.transfer import links

    _, address = ring_peer("echo")
    with pytest.raises(AuthError):
        links.dial(address, b"another-secret-of-at-least-16-bytes", timeout_s=5)
