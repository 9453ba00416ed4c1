"""A transfer commits only when every (block, layer) was verified exactly once (issue 17, defect 1).

The receiver used to count verified blocks per layer, so a LAYER frame sent twice stood in for a
missing one and the transfer committed with stale bytes in the gap. These senders speak the wire
directly (typed messages over FrameIO), so they can send what a correct Sender never would.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvport.errors import ChecksumError, CodecError, ProtocolError
from kvport.protocol.frame import MsgType
from kvport.protocol.sync import FrameIO
from kvport.protocol.transfer import (
    LayerHead,
    TransferAbort,
    TransferAccept,
    TransferBegin,
    TransferCommitted,
    TransferEnd,
)
from kvport.transfer import BlockTableDestination, Receiver, Sender, TransferMeta, inproc
from kvport.transfer.receiver import Incoming

from . import peers

SPEC, N = peers.SPEC, peers.N_BLOCKS
LB = SPEC.bytes_per_layer_block


class CountingDestination(BlockTableDestination):
    """A block table that counts how often each (block, layer) view was handed out."""

    def __init__(self, buffer: np.ndarray, meta: TransferMeta) -> None:
        super().__init__(buffer, range(meta.n_blocks), meta)
        self.views = np.zeros((meta.spec.num_layers, meta.n_blocks), dtype=np.int64)

    def view(self, block: int, layer: int) -> memoryview:
        self.views[layer, block] += 1
        return super().view(block, layer)


def _receiver() -> tuple[FrameIO, Receiver, np.ndarray]:
    a, b = inproc.pair()
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    rx = Receiver(b, SPEC, lambda m: CountingDestination(dst, m), budget_bytes=1 << 20)
    rx.start()
    return FrameIO(a), rx, dst


def _frames(io: FrameIO, src: np.ndarray, frames: list[tuple[int, int, int]]) -> TransferAbort | TransferCommitted:
    """BEGIN, LAYER frames ``(layer, b0, n)`` of ``src``, END; returns the receiver's answer."""
    meta = TransferMeta(SPEC, "raw", peers.keys())
    io.send(MsgType.TRANSFER_BEGIN, TransferBegin(1, meta).to_meta())
    assert TransferAccept.from_meta(io.expect(MsgType.TRANSFER_ACCEPT).meta).tid == 1
    for layer, b0, n in frames:
        views = peers.layer_views(src, SPEC, layer)[b0 : b0 + n]
        io.send(MsgType.LAYER, LayerHead(1, layer, b0).to_meta(), views, LB)
    io.send(MsgType.TRANSFER_END, TransferEnd(1).to_meta())
    while True:
        f = io.read_frame()
        if f.msg_type is MsgType.TRANSFER_ABORT:
            return TransferAbort.from_meta(f.meta)
        if f.msg_type is MsgType.TRANSFER_COMMITTED:
            return TransferCommitted.from_meta(f.meta)


def _all_frames(half: int = N // 2) -> list[tuple[int, int, int]]:
    return [(layer, b0, half) for layer in range(SPEC.num_layers) for b0 in range(0, N, half)]


def _run(frames: list[tuple[int, int, int]]
         ) -> tuple[Incoming, TransferAbort | TransferCommitted, Receiver, np.ndarray]:
    io, rx, dst = _receiver()
    answer = _frames(io, peers.source(), frames)
    inc = rx.next_transfer(5)
    return inc, answer, rx, dst


def test_every_block_layer_is_verified_exactly_once_before_the_commit() -> None:
    inc, answer, rx, dst = _run(_all_frames())
    assert isinstance(answer, TransferCommitted) and answer.tid == 1
    inc.wait(5)
    assert inc.verified.all() and inc.verified.shape == (SPEC.num_layers, N)
    assert (inc.dest.views == 1).all()  # type: ignore[attr-defined]  # each chunk landed once
    assert np.array_equal(dst, peers.source())
    rx.close()


def test_a_frame_sent_twice_instead_of_another_aborts_and_links_nothing() -> None:
    """Layer 2's first half twice, its second half never: the old count saw 8 of 8 blocks."""
    frames = _all_frames()
    frames[frames.index((2, N // 2, N // 2))] = (2, 0, N // 2)
    inc, answer, rx, _ = _run(frames)
    assert isinstance(answer, TransferAbort) and isinstance(answer.error, ProtocolError)
    with pytest.raises(ProtocolError, match="exactly once"):
        inc.wait(5)
    assert inc.state.value == "aborted" and inc.dest.state.value == "aborted"  # type: ignore[attr-defined]
    assert inc.dest.linked == []  # type: ignore[attr-defined]
    assert not inc.verified[2, N // 2 :].any()  # the gap was never verified
    assert (inc.dest.views[2, : N // 2] == 1).all()  # type: ignore[attr-defined]  # the repeat never landed
    assert rx.pool.in_use == 0  # credits returned
    assert rx.error is None  # the stream stayed in sync: the connection lives on
    rx.close()


def test_a_frame_overlapping_an_earlier_one_aborts() -> None:
    frames = _all_frames()
    frames.insert(1, (0, 2, 3))  # blocks 2..4 of layer 0 after 0..3 arrived
    inc, answer, rx, _ = _run(frames)
    assert isinstance(answer, TransferAbort) and isinstance(answer.error, ProtocolError)
    assert inc.state.value == "aborted"
    rx.close()


def test_an_end_with_a_block_layer_missing_aborts() -> None:
    frames = [f for f in _all_frames() if f != (3, N // 2, N // 2)]
    inc, answer, rx, _ = _run(frames)
    assert isinstance(answer, TransferAbort) and "never verified" in str(answer.error)
    assert inc.verified.sum() == SPEC.num_layers * N - N // 2
    rx.close()


def test_wait_for_layer_reads_the_bitmap() -> None:
    """A layer is ready only when every one of its blocks is verified, whatever else arrived."""
    io, rx, _ = _receiver()
    src = peers.source()
    meta = TransferMeta(SPEC, "raw", peers.keys())
    io.send(MsgType.TRANSFER_BEGIN, TransferBegin(1, meta).to_meta())
    io.expect(MsgType.TRANSFER_ACCEPT)
    inc = rx.next_transfer(5)
    for layer, b0, n in [(0, 0, 4), (1, 0, 8), (0, 4, 3)]:
        io.send(MsgType.LAYER, LayerHead(1, layer, b0).to_meta(), peers.layer_views(src, SPEC, layer)[b0 : b0 + n], LB)
    inc.wait_for_layer(1, timeout=5)
    assert not inc.layer_ready(0) and not inc.complete  # 7 of 8 blocks of layer 0
    io.send(MsgType.LAYER, LayerHead(1, 0, 7).to_meta(), peers.layer_views(src, SPEC, 0)[7:], LB)
    inc.wait_for_layer(0, timeout=5)
    assert inc.verified[:2].all() and not inc.verified[2:].any()
    rx.close()


def test_a_chunk_that_does_not_decode_leaves_its_bit_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvport.codec import get_codec
    from kvport.transfer.linkcodec import LinkCodec

    real = LinkCodec.decode_into
    calls = {"n": 0}

    def flaky(self: LinkCodec, chunk: Any, dst: memoryview) -> None:
        calls["n"] += 1
        if calls["n"] == N + 4:  # layer 1, block 3
            raise CodecError("garbage")
        real(self, chunk, dst)

    monkeypatch.setattr(LinkCodec, "decode_into", flaky)
    a, b = inproc.pair()
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    rx = Receiver(b, SPEC, lambda m: BlockTableDestination(dst, range(N), m), budget_bytes=1 << 20,
                  codecs=("raw", "int8"))
    rx.start()
    s = Sender(a, codec=get_codec("int8"))
    kv = np.random.default_rng(5).standard_normal((N, SPEC.bytes_per_block // 2)).astype(np.float16).view(np.uint8)
    with pytest.raises(ChecksumError, match=r"layer 1 blocks \[3\] failed their checksum or did not decode"):
        s.send(TransferMeta(SPEC, "int8", peers.keys()), lambda layer: peers.layer_views(kv, SPEC, layer))
    inc = rx.next_transfer(5)
    assert inc.verified[0].all() and not inc.verified[1].any()
    assert inc.dest.state.value == "aborted"  # type: ignore[attr-defined]
    s.close()
    rx.close()


def test_whole_block_frames_verify_every_block_layer_exactly_once() -> None:
    """Sender.send carries whole blocks per frame (all layers, block-major): same bitmap, same rule."""
    a, b = inproc.pair()
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    rx = Receiver(b, SPEC, lambda m: CountingDestination(dst, m), budget_bytes=1 << 20)
    rx.start()
    s = Sender(a, max_frame_bytes=3 * SPEC.bytes_per_block)  # 3 whole blocks a frame: 3 + 3 + 2
    h = s.send(TransferMeta(SPEC, "blocks", peers.keys()), lambda layer: peers.layer_views(peers.source(), SPEC, layer))
    inc = rx.next_transfer(5).wait(5)
    assert h.state.value == "committed" and inc.verified.all()
    assert (inc.dest.views == 1).all()  # type: ignore[attr-defined]
    assert np.array_equal(dst, peers.source())
    s.close()
    rx.close()


def test_a_whole_block_frame_over_a_layer_frame_aborts() -> None:
    """Block 2's every layer after layer 1 of blocks 0..3 arrived: (2, 1) twice."""
    io, rx, _ = _receiver()
    src = peers.source()
    io.send(MsgType.TRANSFER_BEGIN, TransferBegin(1, TransferMeta(SPEC, "raw", peers.keys())).to_meta())
    io.expect(MsgType.TRANSFER_ACCEPT)
    inc = rx.next_transfer(5)
    io.send(MsgType.LAYER, LayerHead(1, 1, 0).to_meta(), peers.layer_views(src, SPEC, 1)[:4], LB)
    block2 = [peers.layer_views(src, SPEC, layer)[2] for layer in range(SPEC.num_layers)]
    io.send(MsgType.LAYER, LayerHead(1, 0, 2, SPEC.num_layers).to_meta(), block2, LB)
    answer = io.expect(MsgType.TRANSFER_ABORT)
    assert isinstance(TransferAbort.from_meta(answer.meta).error, ProtocolError)
    with pytest.raises(ProtocolError, match="exactly once"):
        inc.wait(5)
    assert inc.verified.sum() == 4  # layer 1 of blocks 0..3; block 2's frame never landed
    rx.close()


@pytest.mark.parametrize(("layer", "n_layers", "b0", "n_chunks"), [(2, 3, 0, 3), (0, 4, 7, 8), (0, 3, 0, 8)],
                         ids=["past-the-last-layer", "past-the-last-block", "not-whole-blocks"])
def test_a_frame_outside_the_transfer_ends_the_connection(layer: int, n_layers: int, b0: int, n_chunks: int) -> None:
    io, rx, dst = _receiver()
    src = peers.source()
    io.send(MsgType.TRANSFER_BEGIN, TransferBegin(1, TransferMeta(SPEC, "raw", peers.keys())).to_meta())
    io.expect(MsgType.TRANSFER_ACCEPT)
    inc = rx.next_transfer(5)
    io.send(MsgType.LAYER, LayerHead(1, layer, b0, n_layers).to_meta(), peers.layer_views(src, SPEC, 0)[:n_chunks], LB)
    with pytest.raises(ProtocolError, match="does not fit"):
        inc.wait(5)
    assert rx.closed.wait(5) and isinstance(rx.error, ProtocolError) and not dst.any()
