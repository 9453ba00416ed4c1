"""The decode engine's inbox as an attacker drives it (issue 25): streams that carry part of a block,
ids used twice, peers without the secret, relays, silent connections and transfers, floods of
refusals. Each ends in nothing linked (the request reads the store or recomputes), never in KV the
request did not get whole and verified, and never in an inbox that stops taking hand-offs."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from kvport.codec.envelope import block_format
from kvport.deadline import Deadline
from kvport.engines.vllm import stream as stream_mod
from kvport.engines.vllm.paged import PagedKV
from kvport.engines.vllm.params import new_stream_id
from kvport.engines.vllm.plan import BlockCopy, StreamCopy
from kvport.engines.vllm.stream import Inbox, InboxServer, StreamOut
from kvport.errors import AuthError, ConfigError, KVPortError, PeerError, TierFullError, TransferError
from kvport.keys import KeyContext, chain_keys
from kvport.protocol.transfer import TransferMeta
from kvport.spec import DType, KVSpec, Layout
from kvport.transfer import links
from kvport.transfer.sender import Sender
from tests.waits import until

from .test_vllm_stream import SECRET, engine_kv, inbox, producer, stream_all

SPEC = KVSpec("m", num_layers=3, num_kv_heads=2, head_dim=8, dtype=DType.FP32, block_size=4, layout=Layout.VLLM_CPU)
CTX = KeyContext(block_size=4, spec_fingerprint=SPEC.fingerprint)
HEADER = block_format(SPEC).header_len


def keys_of(n: int, start: int = 0) -> tuple[bytes, ...]:
    return tuple(bytes(k) for k in chain_keys(list(range(start, start + n * 4)), CTX))


def land(box: Inbox, sid: str, keys: tuple[bytes, ...]) -> None:
    """One transfer of whole blocks as the receiver drives it: reserved, then committed."""
    box.destination(TransferMeta(SPEC, sid, keys)).commit()


served = inbox  # the decode engine's inbox on loopback TCP, shared memory and NIXL (test_vllm_stream's fixture)


# ---------------------------------------------------------------------- completeness
@pytest.mark.parametrize(("lo", "hi"), [(0, 1), (0, 2), (1, 3), (2, 3)])
def test_a_transfer_of_some_layers_is_refused_and_nothing_is_linked(lo: int, hi: int) -> None:
    """A block in the inbox is linked whole: a transfer carrying layers [lo, hi) only (the rest would be a
    previous request's bytes, sealed with fresh checksums by the keeper) never gets a slot."""
    box = Inbox(SPEC, 4, HEADER)
    sid, keys = new_stream_id(), keys_of(2)
    with pytest.raises(TransferError, match="whole blocks"):
        box.destination(TransferMeta(SPEC, sid, keys, layer_lo=lo, layer_hi=hi))
    assert box.free_blocks == 4
    slots, why = box.take(sid, [k for k in keys], Deadline.after(1.0), unknown_wait_s=0.01)
    assert slots == [] and why


def test_a_partial_layer_stream_over_the_wire_is_refused_before_any_byte(served: tuple[Inbox, InboxServer]) -> None:
    box, srv = served
    t = links.dial(srv.address, SECRET)
    s = Sender(t)
    try:
        with pytest.raises(TransferError, match="whole blocks"):
            s.begin(TransferMeta(SPEC, new_stream_id(), keys_of(2), layer_lo=0, layer_hi=2), timeout_s=5.0)
    finally:
        s.close()
    assert box.free_blocks == box.capacity


def test_a_stream_id_is_single_use() -> None:
    box = Inbox(SPEC, 8, HEADER)
    sid, keys = new_stream_id(), keys_of(2)
    land(box, sid, keys)
    slots, why = box.take(sid, list(keys), Deadline.after(1.0))
    assert why == "" and len(slots) == 2
    # the id a request took can never be filled again, not even with the same bytes
    with pytest.raises(TierFullError, match="single-use"):
        box.destination(TransferMeta(SPEC, sid, keys_of(2, start=100)))
    again, why = box.take(sid, list(keys), Deadline.after(1.0), unknown_wait_s=0.01)
    assert again == [] and "single-use" in why
    box.release(slots)
    assert box.free_blocks == 8


def test_a_block_is_written_once_per_stream_and_a_second_write_voids_the_stream() -> None:
    """A second commit under one id used to replace the first one's slots silently."""
    box = Inbox(SPEC, 8, HEADER)
    sid, keys = new_stream_id(), keys_of(3)
    land(box, sid, keys[:2])
    with pytest.raises(TierFullError, match="arrived twice"):
        box.destination(TransferMeta(SPEC, sid, keys[1:]))  # overlaps block 1
    # also while the first transfer of a key is still receiving
    other = new_stream_id()
    first = box.destination(TransferMeta(SPEC, other, keys[:1]))
    with pytest.raises(TierFullError, match="arrived twice"):
        box.destination(TransferMeta(SPEC, other, keys[:1]))
    first.commit()
    # the void stream gives its request only what came whole before the second write, and says why
    slots, why = box.take(sid, list(keys), Deadline.after(1.0))
    assert len(slots) == 2 and "arrived twice" in why
    box.release(slots)
    slots, why = box.take(other, list(keys[:1]), Deadline.after(1.0))
    assert slots == [] and "arrived twice" in why  # its one block committed after the stream was void: freed
    assert box.free_blocks == 8


def test_a_transfer_naming_one_block_twice_is_refused() -> None:
    box = Inbox(SPEC, 8, HEADER)
    k = keys_of(1)
    with pytest.raises(TransferError, match="distinct"):
        box.destination(TransferMeta(SPEC, new_stream_id(), (k[0], k[0])))
    assert box.free_blocks == 8


def test_refused_transfers_do_not_fill_the_stream_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """4096 refused TRANSFER_BEGINs used to fill the table, after which every hand-off was refused."""
    monkeypatch.setattr(stream_mod, "MAX_STREAMS", 8)
    monkeypatch.setattr(stream_mod, "MAX_REFUSED", 4)
    box = Inbox(SPEC, 4, HEADER)
    for _ in range(50):  # each one larger than the inbox: refused
        with pytest.raises(TierFullError):
            box.destination(TransferMeta(SPEC, new_stream_id(), keys_of(5)))
    assert box.streams == 0
    sid = new_stream_id()
    land(box, sid, keys_of(2))  # a real hand-off still lands
    assert len(box.take(sid, [k for k in keys_of(2)], Deadline.after(1.0))[0]) == 2


def test_a_refused_stream_tells_its_request_at_once() -> None:
    box = Inbox(SPEC, 2, HEADER)
    sid = new_stream_id()
    with pytest.raises(TierFullError):
        box.destination(TransferMeta(SPEC, sid, keys_of(3)))
    t0 = time.monotonic()
    slots, why = box.take(sid, [k for k in keys_of(3)], Deadline.after(5.0), unknown_wait_s=3.0)
    assert slots == [] and "free blocks" in why and time.monotonic() - t0 < 2.5


def test_a_stream_nobody_will_take_is_released_at_once() -> None:
    """The decode engine's own prefix cache held the prompt: its stream used to keep its slots until it
    lapsed (30 s), and later hand-offs were refused for want of room."""
    box = Inbox(SPEC, 4, HEADER, ttl_s=3600.0)
    sid = new_stream_id()
    land(box, sid, keys_of(3))
    assert box.free_blocks == 1
    assert box.discard(sid) == 3
    assert box.free_blocks == 4 and box.streams == 0
    with pytest.raises(TierFullError, match="single-use"):  # and the id is spent
        land(box, sid, keys_of(1))
    late = new_stream_id()  # discarded before its transfer committed: the commit frees its slots
    d = box.destination(TransferMeta(SPEC, late, keys_of(2)))
    box.discard(late)
    d.commit()
    assert box.free_blocks == 4


def test_the_planner_discards_the_stream_of_a_hand_off_it_will_not_load() -> None:
    from kvport.engines.vllm.plan import StepPlanner

    p = StepPlanner(CTX, lambda k: False)
    sid = new_stream_id()
    p.discard_stream(sid)
    assert p.step([]).discards == (sid,)
    assert p.step([]).discards == ()


# ---------------------------------------------------------------------- authentication
def raw_connect(address: str) -> socket.socket:
    if address.startswith("shm:"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + address[4:])
    else:  # HOST:PORT, or nixl:HOST:PORT (its control socket)
        host, _, port = address.removeprefix(links.NIXL_PREFIX).rpartition(":")
        s = socket.create_connection((host, int(port)))
    return s


def test_an_inbox_needs_the_deployment_secret() -> None:
    box = Inbox(SPEC, 2, HEADER)
    for secret in (None, b"", b"short"):
        with pytest.raises(ConfigError, match="secret"):
            InboxServer(box, "127.0.0.1:0", secret)


@pytest.mark.parametrize("key", [b"x" * 32, None])
def test_a_peer_without_the_secret_lands_nothing(served: tuple[Inbox, InboxServer], key: bytes | None) -> None:
    """Loopback TCP and shared memory used to take streams from any local process."""
    box, srv = served
    with pytest.raises((AuthError, ConfigError)):
        links.dial(srv.address, key)
    if key is None:  # a peer that skips the handshake and speaks the transfer protocol at once
        s = raw_connect(srv.address)
        s.sendall(b"\0" * 64)
        s.settimeout(10)
        with contextlib.suppress(OSError):
            while s.recv(4096):
                pass
        s.close()
    assert box.free_blocks == box.capacity and box.streams == 0


def test_the_producer_dials_only_its_deployment_s_inboxes(served: tuple[Inbox, InboxServer]) -> None:
    """A request naming an address (kvport_dest) used to be dialled with the shared secret."""
    box, srv = served
    out = StreamOut(SPEC, PagedKV(engine_kv(8, seed=1), SPEC), SECRET, destinations=["127.0.0.1:9"])
    sc = StreamCopy(new_stream_id(), srv.address, BlockCopy("r", tuple(keys_of(2)), (1, 2)), 0)
    assert stream_all(out, [sc]) == [sc]  # not streamed: the producer saves it to the store
    assert srv.connections == 0 and box.streams == 0
    out.close()


class Relay:
    """A listener that passes bytes both ways to ``target``: what an attacker runs after getting a
    producer to dial it, to borrow the producer's answer to the real inbox's challenge."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.relayed = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                a, _ = self.sock.accept()
                b = raw_connect(self.target)
                self.relayed += 1
                for x, y in ((a, b), (b, a)):
                    threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def test_a_relay_of_the_inbox_s_challenge_does_not_authenticate() -> None:
    box = Inbox(SPEC, 4, HEADER)
    srv = InboxServer(box, "127.0.0.1:0", SECRET)
    relay = Relay(srv.address)
    try:
        with pytest.raises((AuthError, PeerError)):  # the producer signed the relay's address, not the inbox's
            links.dial(relay.address, SECRET)
        assert relay.relayed == 1
        out = producer(PagedKV(engine_kv(8, seed=1), SPEC), relay.address)  # even when configured by mistake
        sc = StreamCopy(new_stream_id(), relay.address, BlockCopy("r", tuple(keys_of(2)), (1, 2)), 0)
        assert stream_all(out, [sc]) == [sc]
        assert box.streams == 0 and box.free_blocks == 4
        out.close()
        t = links.dial(srv.address, SECRET)  # the inbox itself, dialled by its own address: accepted
        t.close()
    finally:
        relay.close()
        srv.close()


def test_a_wildcard_inbox_must_be_told_the_address_it_is_dialled_by() -> None:
    with pytest.raises(ConfigError, match="names"):
        links.LinkListener("0.0.0.0:0", SECRET)
    ln = links.LinkListener("0.0.0.0:0", SECRET, names=["10.1.2.3:7000"])
    assert "10.1.2.3:7000" in ln.names
    ln.close()


# ---------------------------------------------------------------------- lockout
def test_a_silent_connection_does_not_hold_up_the_inbox(served: tuple[Inbox, InboxServer]) -> None:
    """The handshake used to run on the only accept thread, with the 1 h idle timeout: one connection
    that sent nothing froze the inbox."""
    _box, srv = served
    silent = [raw_connect(srv.address) for _ in range(3)]
    try:
        out = producer(PagedKV(engine_kv(8, seed=2), SPEC), srv.address)
        sc = StreamCopy(new_stream_id(), srv.address, BlockCopy("r", tuple(keys_of(2)), (3, 4)), 0)
        assert stream_all(out, [sc]) == []  # committed while the silent ones wait for their handshake deadline
        out.close()
        until(lambda: srv.connections <= 1, "the silent connections stayed open", links.HANDSHAKE_S + 10, 0.01)
    finally:
        for s in silent:
            s.close()


def test_connections_are_capped() -> None:
    box = Inbox(SPEC, 2, HEADER)
    srv = InboxServer(box, "127.0.0.1:0", SECRET, max_connections=2)
    held = [raw_connect(srv.address) for _ in range(2)]
    try:
        until(lambda: srv.connections == 2, "the connections never opened", 10.0, 0.01)
        extra = raw_connect(srv.address)
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at accept: over the cap
        extra.close()
        assert srv.connections == 2
    finally:
        for s in held:
            s.close()
        srv.close()


def test_a_producer_that_goes_silent_mid_transfer_gives_its_slots_back() -> None:
    """A transfer begun and never ended used to hold its slots for the 1 h idle timeout."""
    box = Inbox(SPEC, 4, HEADER)
    srv = InboxServer(box, "127.0.0.1:0", SECRET, transfer_s=0.5)
    s = Sender(links.dial(srv.address, SECRET))
    try:
        sid = new_stream_id()
        h = s.begin(TransferMeta(SPEC, sid, keys_of(3)), timeout_s=5.0)
        assert box.free_blocks == 1
        until(lambda: box.free_blocks == 4, "not abandoned past its deadline", 10.0, 0.01)
        with pytest.raises(KVPortError):
            s.end(h, timeout_s=5.0)
        slots, why = box.take(sid, [k for k in keys_of(3)], Deadline.after(1.0))
        assert slots == [] and why
    finally:
        s.close()
        srv.close()


def test_a_decode_engine_that_dies_mid_stream_never_raises_into_the_producer_s_step() -> None:
    """Found by the vLLM fault rows: the inbox's process died mid-stream, the link was closed under
    the producer, and its abort raised out of wait_for_save (ValueError on the closed socket), which
    took the prefill engine down."""
    box = Inbox(SPEC, 8, HEADER)
    srv = InboxServer(box, "127.0.0.1:0", SECRET)
    out = producer(PagedKV(engine_kv(8, seed=7), SPEC), srv.address, tail_s=2.0)
    sc = StreamCopy(new_stream_id(), srv.address, BlockCopy("r", tuple(keys_of(3)), (1, 2, 3)), 0)
    out.begin([sc])
    out.layer(0)
    srv.close()  # the decode engine is gone: its sockets close under the producer
    for o in out._open:
        o.sender.t.close()  # and the sender's own end is closed by its reader on EOF
    for layer in range(1, SPEC.num_layers):
        out.layer(layer)
    committed, failed = out.finish()  # returns the copies to save; raises nothing
    assert committed == [] and failed == [sc]
    out.close()
