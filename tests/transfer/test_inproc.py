"""One process, real threads: transports, ledger hand-off, host-pool destination, streaming, credits."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kvport.bench.transfer_load import tcp_pair
from kvport.codec import get_codec
from kvport.errors import (
    AuthError,
    BackpressureTimeout,
    ChecksumError,
    CodecParamsError,
    ConfigError,
    IncompatibleSpecError,
    PeerError,
    ProtocolError,
)
from kvport.ledger import BlockState, Ledger, Owner
from kvport.protocol.frame import Flags, MsgType, split_chunks
from kvport.protocol.sync import FrameIO
from kvport.tiers.host import HostTier
from kvport.transfer import (
    Backpressure,
    BlockTableDestination,
    LayerMajorDestination,
    Receiver,
    Rejected,
    Sender,
    TransferMeta,
    check_compatible,
    host_tier_factory,
    inproc,
    shm,
)
from kvport.transfer import tcp as tcp_mod
from kvport.transfer.ratelimit import RateLimited, TokenBucket
from kvport.transfer.sender import LayerStreamer

from . import peers

SPEC, N = peers.SPEC, peers.N_BLOCKS


def _pairs() -> dict[str, Any]:
    return {"inproc": inproc.pair, "tcp": tcp_pair, "shm": lambda: shm.pair(1 << 12, 4)}


@pytest.mark.parametrize("kind", ["inproc", "tcp", "shm"])
def test_transport_scatter_gather(kind: str) -> None:
    a, b = _pairs()[kind]()
    data = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8)
    out = np.zeros_like(data)
    th = threading.Thread(target=lambda: b.recv_into([out.data[:3], out.data[3:50_000], out.data[50_000:]]))
    th.start()
    a.send([data.data[:10], b"", data.data[10:77_777], data.data[77_777:]])
    th.join(10)
    assert np.array_equal(out, data)
    assert not b.readable(0.0)
    a.close()
    with pytest.raises(PeerError):
        b.recv_into([memoryview(bytearray(1))])
    b.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="Linux only")
def test_loopback_links_use_a_congestion_control_that_does_not_pace() -> None:
    """Both ends of a loopback link (transfer or raw baseline) drop a pacing default such as BBR."""
    lst = tcp_mod.TcpListener()
    th = threading.Thread(target=lambda: setattr(lst, "got", lst.accept(timeout_s=10)))
    th.start()
    c = tcp_mod.connect("127.0.0.1", lst.port)
    th.join(10)
    for t in (c, lst.got):  # type: ignore[attr-defined]
        cc = t.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")
        assert cc in tcp_mod.LOOPBACK_CONGESTION
    loose = socket.socket()  # not connected: nothing to tell, the system's choice stays
    default = loose.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    tcp_mod.tune(loose)
    assert loose.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16) == default
    loose.close()
    c.close()
    lst.got.close()  # type: ignore[attr-defined]
    lst.close()


def test_shm_readable_with_no_time_left_still_polls_the_control_channel() -> None:
    a, b = shm.pair(1 << 12, 4)
    assert not b.readable(0.0)
    a.send([b"hello"])  # announced on the control socket when send returns
    assert b.readable(0.0)
    out = bytearray(5)
    b.recv_into([memoryview(out)])
    assert out == b"hello"
    a.close()
    b.close()


def test_shm_sender_is_woken_while_another_thread_reads_the_control_channel() -> None:
    """The sending thread (waiting for ring space) and a reader thread (waiting for frames, like the
    Sender's) share one control socket: ring space freed by the peer must wake the sender at once,
    not after the reader's select times out (that cost one timeout per ring turn)."""
    a, b = shm.pair(1 << 14, 4)  # 64 KiB ring: 16 MiB is 256 ring turns
    data = np.random.default_rng(3).integers(0, 256, 16 << 20, dtype=np.uint8)
    out = np.zeros_like(data)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            a.readable(1.0)

    rx = threading.Thread(target=lambda: b.recv_into([out.data]))
    rd = threading.Thread(target=reader)
    rx.start()
    rd.start()
    a.send([data.data])
    silent_while_sending = a.silent_waits
    rx.join(60)
    stop.set()
    rd.join(5)
    assert np.array_equal(out, data)
    assert silent_while_sending <= 8  # was about one per ring turn
    a.close()
    b.close()


def _run(kind: str, dest_factory: Any, sender_kw: dict[str, Any] | None = None, **rx_kw: Any
         ) -> tuple[Sender, Receiver]:
    a, b = _pairs()[kind]()
    rx = Receiver(b, SPEC, dest_factory, budget_bytes=rx_kw.pop("budget", 1 << 20), **rx_kw)
    rx.start()
    return Sender(a, **(sender_kw or {})), rx


def _views(src: np.ndarray) -> Any:
    return lambda layer: peers.layer_views(src, SPEC, layer)


def test_host_tier_destination_and_ledger_hand_off() -> None:
    tier = HostTier(2 * N * SPEC.bytes_per_block, SPEC.bytes_per_block, pin=False)
    ledger, theirs = Ledger(), Ledger()
    prefill, decode = Owner.engine("prefill"), Owner.engine("decode")
    ks = peers.keys()
    for k in ks:
        ledger.register(k, prefill)
    s, rx = _run("inproc", host_tier_factory(tier), {"ledger": ledger, "owner": prefill, "peer": decode},
                 ledger=theirs, owner=decode, peers=(prefill,))
    src = peers.source()
    h = s.send(TransferMeta(SPEC, "r", ks), _views(src))
    assert h.state.value == "committed"
    assert not any(ledger.knows(k) for k in ks)  # handed off: they left the sender's ledger
    assert all(theirs.owner_of(k) == decode and theirs.state_of(k) is BlockState.COMMITTED for k in ks)
    for i, k in enumerate(ks):
        assert bytes(tier.view(k)) == src[i].tobytes()
    # refusal: nothing moves in either ledger, nothing reaches the tier
    ks2 = peers.keys(N, salt=2)
    for k in ks2:
        ledger.register(k, prefill)
    bad = TransferMeta(SPEC.with_(head_dim=64), "r2", ks2)
    with pytest.raises(IncompatibleSpecError) as ei:
        s.send(bad, _views(src))
    assert ei.value.field == "head_dim"
    assert all(ledger.owner_of(k) == prefill and ledger.state_of(k) is BlockState.COMMITTED for k in ks2)
    assert not any(theirs.knows(k) for k in ks2)
    assert tier.used_bytes == N * SPEC.bytes_per_block
    s.close()
    rx.close()


def test_layer_streaming_wait_for_layer_in_order() -> None:
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    s, rx = _run("tcp", lambda m: BlockTableDestination(dst, range(N), m))
    src = peers.source()
    h = s.begin(TransferMeta(SPEC, "stream", peers.keys()))
    inc = rx.next_transfer(5)
    st = LayerStreamer(s, h)
    seen: list[int] = []
    for layer in range(SPEC.num_layers):
        st.push(layer, peers.layer_views(src, SPEC, layer))
        inc.wait_for_layer(layer, timeout=10)  # available before the next layer is even produced
        seen.append(layer)
        assert not inc.layer_ready(layer + 1) if layer + 1 < SPEC.num_layers else True
    st.finish()
    inc.wait(5)
    assert seen == [0, 1, 2, 3] and np.array_equal(dst, src)
    with pytest.raises(Exception, match="not part of transfer"):
        inc.wait_for_layer(99, timeout=0.1)
    s.close()
    rx.close()


def test_layer_major_destination_partial_layer_range() -> None:
    layers = [np.zeros(N * SPEC.bytes_per_layer_block, dtype=np.uint8) for _ in range(SPEC.num_layers)]
    slots = list(range(N))[::-1]
    s, rx = _run("inproc", lambda m: LayerMajorDestination(layers, slots, m))
    src = peers.source()
    meta = TransferMeta(SPEC, "half", peers.keys(), layer_lo=2, layer_hi=4)
    s.send(meta, _views(src))
    lb = SPEC.bytes_per_layer_block
    assert not layers[0].any() and not layers[1].any()
    for layer in (2, 3):
        for i, slot in enumerate(slots):
            assert np.array_equal(layers[layer][slot * lb : (slot + 1) * lb], src[i, layer * lb : (layer + 1) * lb])
    s.close()
    rx.close()


class _Corrupting:
    """Flips one byte of the first large part it sends (after the checksum was computed)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.done = inner, "corrupting", False

    def send(self, parts: Sequence[Any]) -> None:
        out = list(parts)
        for i, p in enumerate(out):
            if not self.done and memoryview(p).nbytes >= SPEC.bytes_per_layer_block:
                b = bytearray(p)
                b[7] ^= 1
                out[i] = b
                self.done = True
        self.inner.send(out)

    def recv_into(self, parts: Sequence[memoryview]) -> None:
        self.inner.recv_into(parts)

    def readable(self, timeout: float) -> bool:
        return bool(self.inner.readable(timeout))

    def close(self) -> None:
        self.inner.close()


def _kv_source() -> np.ndarray:
    """KV-like fp16 values (codecs quantize real numbers; random bytes hold NaNs)."""
    x = np.random.default_rng(5).standard_normal((N, SPEC.bytes_per_block // 2)).astype(np.float16)
    return x.view(np.uint8)


def test_int8_link_sends_half_the_bytes_and_decodes_into_the_block_table() -> None:
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    s, rx = _run("tcp", lambda m: BlockTableDestination(dst, range(N), m), {"codec": get_codec("int8")},
                 codecs=("raw", "int8"))
    src = _kv_source()
    h = s.send(TransferMeta(SPEC, "int8", peers.keys()), _views(src))
    assert h.state.value == "committed" and h.meta.codec_id == "int8"
    assert h.sent_bytes < 0.6 * N * SPEC.bytes_per_block  # what crossed the link
    got, ref = dst.view(np.float16).astype(np.float32), src.view(np.float16).astype(np.float32)
    assert not np.array_equal(got, ref) and np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    s.close()
    rx.close()


def test_codec_link_refused_by_a_raw_only_receiver_and_variable_size_codecs_rejected() -> None:
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    s, rx = _run("inproc", lambda m: BlockTableDestination(dst, range(N), m), {"codec": get_codec("int8")})
    with pytest.raises(IncompatibleSpecError, match="codec"):
        s.send(TransferMeta(SPEC, "refused", peers.keys()), _views(_kv_source()))
    assert not dst.any()
    s.close()
    rx.close()
    a, _b = inproc.pair()
    with pytest.raises(CodecParamsError, match="fixed encoded size"):
        Sender(a, codec=get_codec("lossless")).begin(TransferMeta(SPEC, "lossless", peers.keys()))


def test_checksum_failure_links_nothing_and_connection_survives() -> None:
    tier = HostTier(2 * N * SPEC.bytes_per_block, SPEC.bytes_per_block, pin=False)
    a, b = inproc.pair()
    rx = Receiver(b, SPEC, host_tier_factory(tier), budget_bytes=1 << 20)
    rx.start()
    s = Sender(_Corrupting(a))
    with pytest.raises(ChecksumError):
        s.send(TransferMeta(SPEC, "bad", peers.keys()), _views(peers.source()))
    assert tier.used_bytes == 0 and rx.pool.in_use == 0
    h = s.send(TransferMeta(SPEC, "good", peers.keys(N, salt=1)), _views(peers.source()))  # same connection
    assert h.state.value == "committed" and tier.used_bytes == N * SPEC.bytes_per_block
    s.close()
    rx.close()


def test_backpressure_timeout_returns_credits() -> None:
    lb = SPEC.bytes_per_layer_block
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    s, rx = _run("inproc", lambda m: BlockTableDestination(dst, range(N), m), {"credit_timeout_s": 0.2},
                 budget=4 * lb, auto_release=False)
    h = s.begin(TransferMeta(SPEC, "slow", peers.keys()))
    inc = rx.next_transfer(5)
    assert isinstance(s.try_admit(), Rejected) is False
    with pytest.raises(BackpressureTimeout):
        s.send_layer(h, 0, peers.layer_views(peers.source(), SPEC, 0))  # 8 blocks, credit for 4
    assert isinstance(s.try_admit(), Rejected)  # 4 of 4 in use: above the high watermark
    with pytest.raises(BackpressureTimeout, match="peer: no credit"):  # the sender's reason, typed
        inc.wait(5)
    # an abort gives the pages and the credits back before it wakes a waiter: both are back already
    assert rx.pool.in_use == 0 and inc.dest.state.value == "aborted"


def test_an_abort_wakes_its_waiters_only_once_pages_and_credits_are_back() -> None:
    """A decode engine woken by an abort may free or reuse what the transfer held at once: the
    receiver aborts the destination and returns the credits first (here the destination's abort is
    held until the test lets it go; the waiter must not wake before)."""
    lb = SPEC.bytes_per_layer_block
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    let_go, aborting = threading.Event(), threading.Event()

    class HeldAbort(BlockTableDestination):
        def abort(self) -> None:
            aborting.set()
            assert let_go.wait(10)
            super().abort()

    s, rx = _run("inproc", lambda m: HeldAbort(dst, range(N), m), {"credit_timeout_s": 0.2},
                 budget=4 * lb, auto_release=False)
    try:
        h = s.begin(TransferMeta(SPEC, "held", peers.keys()))
        inc = rx.next_transfer(5)
        with pytest.raises(BackpressureTimeout):
            s.send_layer(h, 0, peers.layer_views(peers.source(), SPEC, 0))  # credit for 4 of 8: the sender aborts
        assert aborting.wait(5)
        assert rx.pool.in_use > 0 and not inc.settled
        with pytest.raises(PeerError, match="not finished"):  # the abort is under way, not done: no waiter wakes
            inc.wait(0.3)
        with pytest.raises(PeerError, match="did not arrive"):
            inc.wait_for_layer(1, 0.1)
        let_go.set()
        with pytest.raises(BackpressureTimeout, match="peer: no credit"):
            inc.wait(5)
        assert inc.settled and rx.pool.in_use == 0 and inc.dest.state.value == "aborted"
    finally:
        let_go.set()
        s.close()
        rx.close()


def test_overload_backpressure_keeps_memory_and_blocks() -> None:
    from kvport.bench.transfer_load import overload

    on = overload(backpressure=True, duration_s=0.6, capacity_bps=32e6)
    off = overload(backpressure=False, duration_s=0.6, capacity_bps=32e6)
    assert on["peak_memory_vs_budget"] <= 1.0 and on["lost_blocks"] == 0 and on["corrupted_blocks"] == 0
    assert off["peak_memory_vs_budget"] > 1.0


def test_rate_limit_paces_sends() -> None:
    bucket = TokenBucket(1e6, burst_bytes=1000)
    assert bucket.take(500) == 0.0
    assert bucket.take(10_000) > 0.0  # debt beyond the bucket is slept off
    a, b = inproc.pair()
    lim = RateLimited(a, TokenBucket(1e9))
    lim.send([b"abc"])
    out = bytearray(3)
    b.recv_into([memoryview(out)])
    assert out == b"abc" and "inproc" in lim.name
    with pytest.raises(ConfigError):
        TokenBucket(0)


def test_non_loopback_bind_requires_secret_and_handshake() -> None:
    with pytest.raises(ConfigError, match="shared secret"):
        tcp_mod.TcpListener("0.0.0.0")
    lst = tcp_mod.TcpListener("127.0.0.1", secret=b"s3cret")
    res: dict[str, Any] = {}

    def serve() -> None:
        for _ in range(2):
            try:
                res.setdefault("ok", []).append(lst.accept(timeout_s=10))
            except AuthError as exc:
                res["err"] = exc

    th = threading.Thread(target=serve)
    th.start()
    c = tcp_mod.connect("127.0.0.1", lst.port, secret=b"s3cret")
    with pytest.raises(AuthError):
        tcp_mod.connect("127.0.0.1", lst.port, secret=b"wrong")
    th.join(10)
    assert len(res["ok"]) == 1 and isinstance(res["err"], AuthError)
    c.send([b"x"])
    buf = bytearray(1)
    res["ok"][0].recv_into([memoryview(buf)])
    assert buf == b"x"
    c.close()
    lst.close()


def test_meta_validation_and_compat_order() -> None:
    meta = TransferMeta(SPEC, "r", peers.keys())
    wire = meta.to_wire()
    back = TransferMeta.from_wire(wire)
    assert back.to_wire() == wire and back.layers == meta.layers and back.total_bytes == meta.total_bytes
    for key, val in [("fingerprint", b"x" * 16), ("block_keys", [b"short"]), ("token_range", [0, 1]),
                     ("layer_range", [0, 99]), ("request_id", 5), ("chunk_bytes", -1)]:
        with pytest.raises(ProtocolError):
            TransferMeta.from_wire({**wire, key: val})
    with pytest.raises(ProtocolError, match="lacks"):
        TransferMeta.from_wire({k: v for k, v in wire.items() if k != "codec"})
    other = TransferMeta(SPEC.with_(model_id="other", dtype=SPEC.dtype), "r", peers.keys())
    with pytest.raises(IncompatibleSpecError) as ei:
        check_compatible(SPEC, other)
    assert ei.value.field == "model_id"
    with pytest.raises(IncompatibleSpecError, match="codec"):
        check_compatible(SPEC, TransferMeta(SPEC, "r", peers.keys(), codec_id="int8"))


def test_async_and_sync_shells_share_the_format() -> None:
    """The asyncio shell (the server's) and the blocking shell (clients, transfers) speak one format."""
    from kvport.protocol.aio import AsyncFrames, SockStream
    from kvport.protocol.frame import DEFAULT_LIMITS

    async def main() -> tuple[Any, Any]:
        loop = asyncio.get_running_loop()
        ls = socket.create_server(("127.0.0.1", 0))
        ls.setblocking(False)
        port = ls.getsockname()[1]

        def client() -> Any:
            t = tcp_mod.connect("127.0.0.1", port)
            io = FrameIO(t)
            io.send(MsgType.GET, {"key": b"k" * 16}, corr_id=42)
            ans = io.read_frame()
            t.close()
            return ans

        fut = asyncio.ensure_future(asyncio.to_thread(client))
        sock, _ = await loop.sock_accept(ls)
        frames = AsyncFrames(SockStream(sock, "test"), DEFAULT_LIMITS)
        await frames.wait_frame()
        hdr = await frames.read_header()
        meta = await frames.read_meta(hdr)
        await frames.send(MsgType.GET, {"ok": True}, split_chunks(b"abcdef", 4), 4, flags=Flags.RESPONSE,
                          corr_id=hdr.corr_id)
        ans = await fut
        sock.close()
        ls.close()
        return (hdr, meta), ans

    (hdr, meta), ans = asyncio.run(main())
    assert hdr.msg_type is MsgType.GET and meta == {"key": b"k" * 16} and hdr.corr_id == 42
    assert ans.msg_type is MsgType.GET and ans.header.corr_id == 42 and ans.meta == {"ok": True}
    assert ans.payload == b"abcdef" and ans.header.flags & Flags.RESPONSE


def test_backpressure_switch_off_never_waits() -> None:
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    off = Backpressure(enabled=False)
    s, rx = _run("inproc", lambda m: BlockTableDestination(dst, range(N), m), {"bp": off},
                 budget=SPEC.bytes_per_layer_block, bp=off, auto_release=False)
    s.send(TransferMeta(SPEC, "r", peers.keys()), _views(peers.source()))
    assert np.array_equal(dst, peers.source())
    s.close()
    rx.close()


def test_striped_tcp_carries_a_transfer() -> None:
    from kvport.transfer.striped import split_stream

    per = split_stream([memoryview(bytes(range(10)))], start=3, stripe=4, n=2)
    # stream offsets 3 | 4-7 | 8-11 | 12 -> stripes 0 1 2 3 -> connections 0 1 0 1
    assert [b"".join(bytes(v) for v in p) for p in per] == [bytes([0, 5, 6, 7, 8]), bytes([1, 2, 3, 4, 9])]
    lst = tcp_mod.TcpListener()
    out: dict[str, Any] = {}
    th = threading.Thread(target=lambda: out.setdefault("t", lst.accept_striped(3, stripe_bytes=1000)))
    th.start()
    c = tcp_mod.connect_striped("127.0.0.1", lst.port, 3, stripe_bytes=1000)
    th.join(10)
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    rx = Receiver(out["t"], SPEC, lambda m: BlockTableDestination(dst, range(N), m), budget_bytes=1 << 20)
    rx.start()
    s = Sender(c)
    h = s.send(TransferMeta(SPEC, "striped", peers.keys()), _views(peers.source()))
    assert h.state.value == "committed" and np.array_equal(dst, peers.source())
    assert c.name == f"tcp->127.0.0.1:{lst.port}x3"
    s.close()
    rx.close()
    lst.close()
