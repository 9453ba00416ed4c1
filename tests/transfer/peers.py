"""Peer programs for two-process tests (spawned children; each reports through a queue)."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

import numpy as np

from kvport import memops
from kvport.ledger import Ledger, Owner
from kvport.protocol.frame import MsgType, encode_frame, frame_bytes
from kvport.protocol.sync import FrameIO
from kvport.protocol.transfer import LayerHead, TransferAccept, TransferBegin
from kvport.spec import DType, KVSpec
from kvport.transfer import BlockTableDestination, Receiver, Sender, TransferMeta
from kvport.transfer import shm as shm_mod
from kvport.transfer import tcp as tcp_mod

SPEC = KVSpec("test/model", num_layers=4, num_kv_heads=2, head_dim=32, dtype=DType.FP16, block_size=16,
              revision="r1")
N_BLOCKS = 8


def keys(n: int = N_BLOCKS, salt: int = 0) -> tuple[bytes, ...]:
    return tuple(bytes([salt]) * 8 + i.to_bytes(8, "little") for i in range(n))


def source(spec: KVSpec = SPEC, n: int = N_BLOCKS) -> np.ndarray:
    """Deterministic LKHTD blocks: (n, bytes_per_block) uint8."""
    return np.random.default_rng(1234).integers(0, 256, (n, spec.bytes_per_block), dtype=np.uint8)


def layer_views(src: np.ndarray, spec: KVSpec, layer: int) -> list[memoryview]:
    lb = spec.bytes_per_layer_block
    return [src[i, layer * lb : (layer + 1) * lb].data for i in range(src.shape[0])]


def _connect(kind: str, where: Any) -> Any:
    if kind == "tcp":
        return tcp_mod.connect("127.0.0.1", where, timeout_s=10)
    return shm_mod.connect(where, 1 << 16, 4, 10)


def sender_main(kind: str, where: Any, mode: str, q: Any) -> None:
    """mode: ok | registered | registered-digests | registered-bad-digest | mismatch | die | reset."""
    t = _connect(kind, where)
    spec = SPEC.with_(dtype=DType.BF16) if mode == "mismatch" else SPEC
    if mode.startswith("registered") and kind == "shm":
        src = np.frombuffer(t.register(N_BLOCKS * spec.bytes_per_block), dtype=np.uint8).reshape(N_BLOCKS, -1)
        src[:] = source(spec)
    else:
        src = source(spec)
    s = Sender(t, credit_timeout_s=10)
    meta = TransferMeta(spec, f"req-{mode}", keys())
    try:
        h = s.begin(meta, timeout_s=10)
        for layer in meta.layers:
            if layer == 2 and mode in ("die", "reset"):
                if mode == "reset" and kind == "tcp":
                    t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    t.sock.close()  # RST
                os._exit(3)
            digests = None
            if mode in ("registered-digests", "registered-bad-digest"):  # the producer's own checksums
                made = bytearray(memops.xxh3_many(layer_views(src, spec, layer)))
                if mode == "registered-bad-digest" and layer == 1:
                    made[8 * 3] ^= 1  # block 3 of layer 1 announced with a wrong checksum
                digests = bytes(made)
            s.send_layer(h, layer, layer_views(src, spec, layer), digests)
        s.end(h, timeout_s=10)
        q.put(("ok", h.state.value))
    except Exception as exc:
        q.put((type(exc).__name__, getattr(exc, "field", str(exc))))
    finally:
        s.close()


def raw_main(port: int, blob: bytes, q: Any) -> None:
    """Send crafted bytes; report the typed answer (ERROR frame) or how the connection ended."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(blob)
    if q is None:
        s.shutdown(socket.SHUT_WR)
        time.sleep(0.2)
        s.close()
        return
    io = FrameIO(tcp_mod.TcpTransport(s, 10))
    try:
        f = io.read_frame()
        q.put((f.msg_type.name, f.meta.get("error")))
    except Exception as exc:
        q.put(("closed", type(exc).__name__))


def corrupt_sender_main(port: int, q: Any) -> None:
    """A well-formed BEGIN, then a LAYER frame whose chunk bytes were flipped after hashing."""
    t = tcp_mod.connect("127.0.0.1", port, timeout_s=10)
    io = FrameIO(t)
    meta = TransferMeta(SPEC, "req-corrupt", keys())
    io.send(MsgType.TRANSFER_BEGIN, TransferBegin(1, meta).to_meta())
    acc = io.read_frame()
    src = source()
    buf = bytearray(frame_bytes(encode_frame(MsgType.LAYER, LayerHead(1, 0, 0).to_meta(),
                                             layer_views(src, SPEC, 0), SPEC.bytes_per_layer_block)))
    buf[-100] ^= 0xFF  # inside the last chunk's data
    t.send([bytes(buf)])
    while True:
        f = io.read_frame()
        if f.msg_type is not MsgType.CREDIT:
            q.put((acc.msg_type.name, f.msg_type.name, f.meta.get("error")))
            break
    t.close()


def stalled_receiver_main(port: int, q: Any) -> None:
    """Accept one transfer with a huge grant (as engine:decode), then never read again."""
    t = tcp_mod.connect("127.0.0.1", port, timeout_s=30)
    t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    io = FrameIO(t)
    begin = TransferBegin.from_meta(io.read_frame().meta)
    io.send(MsgType.TRANSFER_ACCEPT, TransferAccept(begin.tid, 1 << 40, 1 << 40, str(DECODE)).to_meta())
    q.put("stalled")
    time.sleep(60)


# ---------------------------------------------------------------------- ownership across processes
PREFILL, DECODE = Owner.engine("prefill"), Owner.engine("decode")


def history(ledger: Ledger) -> list[tuple[str, str, str, str, str | None]]:
    """A ledger's moves as plain data (move, key hex, from, to, transfer id) for the parent."""
    return [(r.move.value, r.key.hex(), str(r.owner_from), str(r.owner_to), r.tid) for r in ledger.history]


def handoff_receiver_main(conn: Any) -> None:
    """The decode process: its own ledger, prefill its one known peer. Sends its port, then (after
    the transfer) its ledger's history and whether the bytes arrived intact, or the error."""
    lst = tcp_mod.TcpListener()
    conn.send(lst.port)
    ledger = Ledger()
    dst = np.zeros((N_BLOCKS, SPEC.bytes_per_block), dtype=np.uint8)
    try:
        rx = Receiver(lst.accept(timeout_s=60), SPEC, lambda m: BlockTableDestination(dst, range(N_BLOCKS), m),
                      budget_bytes=1 << 20, ledger=ledger, owner=DECODE, peers=(PREFILL,))
        rx.start()
        inc = rx.next_transfer(timeout=60).wait(timeout=60)
        conn.send({"state": inc.state.value, "history": history(ledger), "intact": bool(np.array_equal(dst, source()))})
        rx.closed.wait(60)  # the sender hangs up first: it has read TRANSFER_COMMITTED by then
        rx.close()
    except Exception as exc:
        conn.send({"error": repr(exc), "history": history(ledger)})
    lst.close()


def handoff_sender_main(port: int, conn: Any) -> None:
    """The prefill process: owns the blocks in its ledger, hands them to decode; sends its history."""
    ledger = Ledger()
    for k in keys():
        ledger.register(k, PREFILL)
    try:
        s = Sender(tcp_mod.connect("127.0.0.1", port, timeout_s=60), ledger=ledger, owner=PREFILL, peer=DECODE)
        src = source()
        h = s.send(TransferMeta(SPEC, "handoff", keys()), lambda layer: layer_views(src, SPEC, layer), timeout_s=60)
        conn.send({"state": h.state.value, "ledger_tid": h.ledger_tid, "history": history(ledger)})
        s.close()
    except Exception as exc:
        conn.send({"error": repr(exc), "history": history(ledger)})
