"""A transfer's deadline bounds the sender's every wait (issue 17: a hand-off fails, it never hangs).

Real TCP on 127.0.0.1. The faults the deadline must end: a receiver that stops granting credits
(its consumer stopped: the frame it waits for never came), a peer that never answers, and a peer
that stops reading the socket at all (a partitioned link: the write itself blocks). Each would
otherwise wait for the 60 s credit timeout, or, for a blocked write on a socket without a timeout,
for TCP's own retransmission timeout (many minutes).
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvport.deadline import Deadline, within
from kvport.errors import DeadlineExceeded, PeerError
from kvport.ledger import BlockState, Ledger, Owner
from kvport.protocol.net import SocketTransport
from kvport.transfer import Backpressure, BlockTableDestination, Receiver, Sender, TransferMeta
from kvport.transfer.sender import OutState
from kvport.transfer.tcp import TcpListener, connect

from . import peers

SPEC, N = peers.SPEC, peers.N_BLOCKS
PREFILL, DECODE = Owner.engine("prefill"), Owner.engine("decode")
FAR = 30.0  # well under the 60 s credit timeout the sender is built with: "it did not wait for that"


def _sender(port: int, ledger: Ledger | None = None) -> Sender:
    t = connect("127.0.0.1", port, timeout_s=None)  # as the demo's link: no socket timeout at all
    if ledger is None:
        return Sender(t, Backpressure(), credit_timeout_s=60.0)
    return Sender(t, Backpressure(), credit_timeout_s=60.0, ledger=ledger, owner=PREFILL, peer=DECODE)


def test_no_credit_before_the_deadline_aborts_and_gives_the_blocks_back() -> None:
    """The receiver's budget holds two layers and it never releases (auto_release off, no consumer):
    the sender runs out of credit at layer 3 and the deadline, not the credit timeout, ends it."""
    listener = TcpListener("127.0.0.1", 0, timeout_s=None)
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    mine = Ledger()
    keys = peers.keys()
    for k in keys:
        mine.register(k, PREFILL)
    accepted: list[Receiver] = []

    def accept() -> None:
        rx = Receiver(listener.accept(timeout_s=10), SPEC, lambda m: BlockTableDestination(dst, range(N), m),
                      2 * N * SPEC.bytes_per_layer_block, Backpressure(), auto_release=False,
                      ledger=Ledger(), owner=DECODE, peers=[PREFILL])
        rx.start()
        accepted.append(rx)

    th = threading.Thread(target=accept)
    th.start()
    tx = _sender(listener.port, mine)
    th.join(10)
    src = peers.source()
    try:
        t0 = time.monotonic()
        h = tx.begin(TransferMeta(SPEC, "r", keys), deadline=Deadline.after(1.0))
        with pytest.raises(DeadlineExceeded, match="credit"):
            for layer in range(SPEC.num_layers):
                tx.send_layer(h, layer, peers.layer_views(src, SPEC, layer))
        assert time.monotonic() - t0 < FAR
        assert h.state is OutState.ABORTED and isinstance(h.error, DeadlineExceeded)
        # nothing was handed off: every block is the sender's engine's again
        assert all(mine.owner_of(k) == PREFILL and mine.state_of(k) is BlockState.COMMITTED for k in keys)
    finally:
        tx.close()
        for rx in accepted:
            rx.close()
        listener.close()


def test_a_peer_that_never_answers_ends_at_the_deadline() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    th = threading.Thread(target=lambda: held.append(srv.accept()[0]))
    th.start()
    tx = _sender(srv.getsockname()[1])
    th.join(10)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="TRANSFER_BEGIN"):
            tx.begin(TransferMeta(SPEC, "r", peers.keys()), timeout_s=60.0, deadline=Deadline.after(0.5))
        assert time.monotonic() - t0 < FAR
    finally:
        tx.close()
        for c in held:
            c.close()
        srv.close()


def test_a_write_to_a_peer_that_stopped_reading_stops_at_the_deadline() -> None:
    """The socket has no timeout (a reader thread may block on it); the deadline still ends the
    write, with PeerError (the frame is cut: the connection is unusable), and the socket keeps
    having no timeout."""
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    t = SocketTransport(a, timeout_s=None)
    payload = memoryview(bytearray(64 << 20))  # far more than both buffers hold
    try:
        t.send([payload[:4096]])  # without a deadline a write that fits goes out as before
        t0 = time.monotonic()
        with within(Deadline.after(0.5)), pytest.raises(PeerError, match="deadline"):
            t.send([payload])
        assert time.monotonic() - t0 < FAR
        assert a.gettimeout() is None
    finally:
        t.close()
        b.close()
        srv.close()


def test_the_deadline_leaves_a_transfer_that_makes_it_alone() -> None:
    """A generous deadline changes nothing: the transfer commits and the data is exact."""
    listener = TcpListener("127.0.0.1", 0, timeout_s=None)
    dst = np.zeros((N, SPEC.bytes_per_block), dtype=np.uint8)
    got: list[Receiver] = []

    def accept() -> None:
        rx = Receiver(listener.accept(timeout_s=10), SPEC, lambda m: BlockTableDestination(dst, range(N), m),
                      1 << 20, Backpressure())
        rx.start()
        got.append(rx)

    th = threading.Thread(target=accept)
    th.start()
    tx = _sender(listener.port)
    th.join(10)
    src = peers.source()
    try:
        h = tx.send(TransferMeta(SPEC, "r", peers.keys()), lambda la: peers.layer_views(src, SPEC, la),
                    deadline=Deadline.after(20.0))
        assert h.state is OutState.COMMITTED
        assert np.array_equal(dst, src)
    finally:
        tx.close()
        for rx in got:
            rx.close()
        listener.close()
