"""Two real processes exchange KV over each transport, including every fault of the issue."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvport.bench.transfer_load import scenario_spec
from kvport.errors import ChecksumError, PeerError, ProtocolError, TransferError
from kvport.ledger import BlockState, Ledger
from kvport.protocol.frame import VERSION, MsgType, encode_frame, frame_bytes
from kvport.protocol.transfer import LayerHead, TransferBegin
from kvport.tiers.host import HostTier
from kvport.transfer import BlockTableDestination, Receiver, Sender, TransferMeta, host_tier_factory
from kvport.transfer import shm as shm_mod
from kvport.transfer import tcp as tcp_mod

from . import peers

CTX = mp.get_context("spawn")


@contextmanager
def child(target: Any, *args: Any) -> Iterator[tuple[Any, Any]]:
    q = CTX.Queue()
    p = CTX.Process(target=target, args=(*args, q), daemon=True)
    p.start()
    try:
        yield p, q
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


def _accept(kind: str, listener: Any) -> Any:
    return listener.accept(timeout_s=30) if kind == "tcp" else listener.accept(1 << 16, 4, timeout_s=30)


def _listener(kind: str) -> Any:
    return tcp_mod.TcpListener() if kind == "tcp" else shm_mod.ShmListener()


def _where(listener: Any) -> Any:
    return listener.port if isinstance(listener, tcp_mod.TcpListener) else listener.address


def _block_table_receiver(t: Any) -> tuple[Receiver, np.ndarray]:
    dst = np.zeros((peers.N_BLOCKS, peers.SPEC.bytes_per_block), dtype=np.uint8)
    rx = Receiver(t, peers.SPEC, lambda m: BlockTableDestination(dst, range(peers.N_BLOCKS), m),
                  budget_bytes=2 * peers.SPEC.bytes_per_layer_block * peers.N_BLOCKS)
    rx.start()
    return rx, dst


@pytest.mark.parametrize(("kind", "mode"), [("tcp", "ok"), ("tcp", "registered-digests"), ("shm", "ok"),
                                           ("shm", "registered"), ("shm", "registered-digests")])
def test_kv_between_two_processes(kind: str, mode: str) -> None:
    lst = _listener(kind)
    with child(peers.sender_main, kind, _where(lst), mode) as (_, q):
        t = _accept(kind, lst)
        rx, dst = _block_table_receiver(t)
        inc = rx.next_transfer(timeout=20)
        for layer in range(peers.SPEC.num_layers):
            inc.wait_for_layer(layer, timeout=20)
        inc.wait(timeout=20)
        assert q.get(timeout=20) == ("ok", "committed")
        assert np.array_equal(dst, peers.source())
        assert inc.meta.request_id == f"req-{mode}" and inc.meta.token_range == (0, peers.N_BLOCKS * 16)
        if kind == "shm":  # registered KV travels as one described payload per LAYER frame, copied natively
            assert t.described_payloads == (peers.SPEC.num_layers if mode.startswith("registered") else 0)
        rx.close()
    lst.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_wrong_producer_digest_fails_the_transfer_and_links_nothing(kind: str) -> None:
    """Checksums the producer computed travel as they are: one that does not match its bytes makes
    the receiver abort (ChecksumError on both sides), whatever the transport."""
    lst = _listener(kind)
    with child(peers.sender_main, kind, _where(lst), "registered-bad-digest") as (_, q):
        t = _accept(kind, lst)
        rx, _ = _block_table_receiver(t)
        inc = rx.next_transfer(timeout=20)
        with pytest.raises(ChecksumError, match="layer 1 blocks \\[3\\]"):
            inc.wait(timeout=20)
        assert q.get(timeout=20)[0] == "ChecksumError"
        assert inc.state.value == "aborted"
        rx.close()
    lst.close()


def test_mismatched_spec_refused_on_both_sides() -> None:
    lst = _listener("tcp")
    with child(peers.sender_main, "tcp", lst.port, "mismatch") as (_, q):
        rx, dst = _block_table_receiver(_accept("tcp", lst))
        assert q.get(timeout=20) == ("IncompatibleSpecError", "dtype")
        assert [getattr(e, "field", None) for e in rx.refusals] == ["dtype"]
        assert not dst.any()  # no payload accepted
        rx.close()
    lst.close()


@pytest.mark.parametrize(("kind", "mode"), [("tcp", "die"), ("shm", "die"), ("tcp", "reset")])
def test_sender_dies_or_resets_mid_stream(kind: str, mode: str) -> None:
    tier = HostTier(4 * peers.N_BLOCKS * peers.SPEC.bytes_per_block, peers.SPEC.bytes_per_block, pin=False)
    lst = _listener(kind)
    with child(peers.sender_main, kind, _where(lst), mode) as (p, _):
        t = _accept(kind, lst)
        rx = Receiver(t, peers.SPEC, host_tier_factory(tier), budget_bytes=1 << 20)
        rx.start()
        inc = rx.next_transfer(timeout=20)
        if mode == "die":
            # the first layers normally arrive before the death is seen; but an RST may discard bytes the
            # receiver had not read yet, and on shm the closed control channel may be seen first
            with contextlib.suppress(PeerError):
                inc.wait_for_layer(1, timeout=20)
        with pytest.raises(PeerError):
            inc.wait(timeout=20)
        with pytest.raises(PeerError):
            inc.wait_for_layer(3, timeout=5)
        p.join(10)
        assert p.exitcode == 3
    assert inc.state.value == "aborted"
    assert tier.used_bytes == 0 and not any(tier.contains(k) for k in peers.keys(peers.N_BLOCKS))  # nothing linked
    assert rx.pool.in_use == 0  # credits returned
    lst.close()


def _valid_begin() -> bytes:
    meta = TransferMeta(peers.SPEC, "raw", peers.keys())
    return frame_bytes(encode_frame(MsgType.TRANSFER_BEGIN, TransferBegin(1, meta).to_meta()))


def _header(magic: bytes = b"KVPT", version: int = VERSION, meta_len: int = 0, chunk: int = 0,
            payload: int = 0) -> bytes:
    return struct.pack("<4sBBHIIQQII", magic, version, 0, int(MsgType.LAYER), meta_len, chunk, payload, 0, 0, 0)


@pytest.mark.parametrize(
    ("blob", "answer"),
    [
        (b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 40, ("ERROR", "ProtocolError")),  # bad magic
        (_header(version=9), ("ERROR", "ProtocolError")),  # unknown version
        (_header(meta_len=1 << 30), ("ERROR", "ProtocolError")),  # oversized header (metadata)
        (_header(chunk=1 << 20, payload=1 << 50), ("ERROR", "ProtocolError")),  # oversized payload
    ],
    ids=["bad-magic", "unknown-version", "oversized-header", "oversized-payload"],
)
def test_bad_frames_get_a_typed_answer(blob: bytes, answer: tuple[str, str]) -> None:
    lst = _listener("tcp")
    with child(peers.raw_main, lst.port, blob) as (_, q):
        rx, dst = _block_table_receiver(_accept("tcp", lst))
        assert q.get(timeout=20) == answer
        assert rx.closed.wait(10)
        assert isinstance(rx.error, ProtocolError)
        assert not dst.any()
    lst.close()


def test_truncated_frame() -> None:
    lst = _listener("tcp")
    begin = _valid_begin()
    layer = frame_bytes(encode_frame(MsgType.LAYER, LayerHead(1, 0, 0).to_meta(),
                                     peers.layer_views(peers.source(), peers.SPEC, 0),
                                     peers.SPEC.bytes_per_layer_block))
    with child(peers.raw_main, lst.port, begin + layer[: len(layer) // 2]) as (_, __):
        rx, _dst = _block_table_receiver(_accept("tcp", lst))
        inc = rx.next_transfer(timeout=20)
        with pytest.raises(PeerError, match="closed"):
            inc.wait(timeout=20)
        assert isinstance(rx.error, PeerError)
        assert inc.dest.state.value == "aborted"  # type: ignore[attr-defined]
    lst.close()


def test_checksum_mismatch_typed_on_both_sides() -> None:
    lst = _listener("tcp")
    with child(peers.corrupt_sender_main, lst.port) as (_, q):
        rx, _dst = _block_table_receiver(_accept("tcp", lst))
        inc = rx.next_transfer(timeout=20)
        with pytest.raises(ChecksumError):
            inc.wait(timeout=20)
        assert q.get(timeout=20) == ("TRANSFER_ACCEPT", "TRANSFER_ABORT", "ChecksumError")
        assert inc.dest.state.value == "aborted"  # type: ignore[attr-defined]
        assert rx.pool.in_use == 0
        rx.close()
    lst.close()


def test_peer_that_stops_reading() -> None:
    spec = scenario_spec()  # 64 KiB block-layers
    n = 128  # 32 MiB: far more than both socket buffers
    src = np.ones((n, spec.bytes_per_block), dtype=np.uint8)
    ks = peers.keys(n, salt=9)
    ledger = Ledger()
    me, peer = peers.PREFILL, peers.DECODE
    for k in ks:
        ledger.register(k, me)
    lst = _listener("tcp")
    with child(peers.stalled_receiver_main, lst.port) as (p, q):
        t = lst.accept(timeout_s=30)
        t.settimeout(1.0)
        s = Sender(t, ledger=ledger, owner=me, peer=peer)
        meta = TransferMeta(spec, "stall", ks)
        h = s.begin(meta, timeout_s=20)
        assert q.get(timeout=20) == "stalled"
        assert all(ledger.state_of(k) is BlockState.IN_TRANSFER for k in ks)
        with pytest.raises(PeerError, match="stopped reading"):
            for layer in meta.layers:
                s.send_layer(h, layer, peers.layer_views(src, spec, layer))
        assert h.state.value == "aborted"
        assert all(ledger.owner_of(k) == me and ledger.state_of(k) is BlockState.COMMITTED for k in ks)
        assert s.window.available == 0  # credits void with the connection
        with pytest.raises(TransferError):
            s.begin(TransferMeta(spec, "after", ks))
        p.kill()
    lst.close()


def test_hand_off_between_two_processes_is_recorded_by_both_ledgers() -> None:
    """Prefill and decode in their own processes, each with its own ledger, over TCP on 127.0.0.1:
    the sender's history shows HANDED_OFF to decode and the receiver's ACQUIRE from prefill, both
    under the one transfer id that crossed the wire."""
    r_in, r_out = CTX.Pipe(duplex=False)
    s_in, s_out = CTX.Pipe(duplex=False)
    rproc = CTX.Process(target=peers.handoff_receiver_main, args=(r_out,), daemon=True)
    rproc.start()
    try:
        assert r_in.poll(20)
        port = r_in.recv()
        sproc = CTX.Process(target=peers.handoff_sender_main, args=(port, s_out), daemon=True)
        sproc.start()
        try:
            assert s_in.poll(90) and r_in.poll(90)
            sent, got = s_in.recv(), r_in.recv()
        finally:
            sproc.join(30)
    finally:
        rproc.join(30)
        for p in (rproc, sproc):
            if p.is_alive():
                p.kill()
    assert "error" not in sent and "error" not in got, (sent, got)
    tid = sent["ledger_tid"]
    keys = [k.hex() for k in peers.keys(peers.N_BLOCKS)]
    assert sent["state"] == "committed" and got["state"] == "committed" and got["intact"]
    handed = [(key, to, t) for move, key, _, to, t in sent["history"] if move == "handed_off"]
    assert handed == [(k, str(peers.DECODE), tid) for k in keys]
    acquired = [(key, frm, to, t) for move, key, frm, to, t in got["history"] if move == "acquire"]
    assert acquired == [(k, str(peers.PREFILL), str(peers.DECODE), tid) for k in keys]
    assert [m for m, *_ in got["history"]] == ["acquire"] * len(keys)  # nothing else happened there
