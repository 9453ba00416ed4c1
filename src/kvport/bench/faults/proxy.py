"""The fault benchmark's TCP proxy: a process between a kvport client and its peer that understands
kvport frames and does one armed thing to them (``python -m kvport.bench.faults.proxy``).

::

    client --TCP--> [listen]  proxy  [upstream] --TCP--> peer
                    client -> peer: frame by frame (header, meta, payload read whole)
                    peer -> client: bytes as they come
    stdin:  one JSON command per line         stdout: one JSON event per line

Commands: ``{"cmd": "arm", "action": A, "type": T, "nth": K, ...}`` arms one action on the K-th frame
of message type T (a :class:`~kvport.protocol.frame.MsgType` value) counted from now; ``release`` lets
a held stream go on; ``disarm``; ``upstream`` (``host``, ``port``) for the next connection; ``close``
(drop the live connection); ``quit``. Actions:

* ``flip``  flip one bit of one payload chunk (its checksum then fails at the receiver)
* ``dup``   forward the frame twice
* ``drop``  do not forward the frame
* ``hold``  stop before the frame; event ``held``; go on at ``release`` (or when the link drops)
* ``spec``  rewrite a TRANSFER_BEGIN's spec: ``field`` changed (:data:`SPEC_CHANGES`), the
  fingerprint and ranges made consistent again, the header check recomputed
* ``throttle``  forward the client's bytes at ``bps`` bytes/s until ``disarm`` (a slow link)

Events: ``listening`` (``port``), ``accepted`` (``conn``: a number per connection), ``injected``
(``action``, ``detail``), ``held``, ``closed`` (``conn``, ``why``). ``--plain`` relays bytes both
ways without parsing (the network namespace's relays). One connection at a time: a new one
replaces the old.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from kvport.errors import KVPortError, ProtocolError
from kvport.protocol.frame import CHECKSUM_BYTES, HEADER_BYTES, Limits, MsgType, decode_header, encode_header
from kvport.spec import KVSpec

_LIMITS = Limits(max_meta_bytes=64 << 20, max_payload_bytes=1 << 34, max_chunk_bytes=1 << 30, max_chunks=1 << 24)
_PIECE = 64 << 10  # a throttled stream is sent in pieces this large

# field -> change of a spec map; each leaves a valid KVSpec that differs from the original in that field
# (a tp_rank of a tp_size-1 spec can only change together with tp_size: the receiver then names tp_size)
SPEC_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "model_id": lambda s: s.update(model_id=s["model_id"] + "-other"),
    "revision": lambda s: s.update(revision=(s["revision"] or "main") + "-other"),
    "dtype": lambda s: s.update(dtype="bf16" if s["dtype"] != "bf16" else "fp16"),
    "layout": lambda s: s.update(layout="hf" if s["layout"] != "hf" else "lkhtd"),
    "num_layers": lambda s: s.update(num_layers=s["num_layers"] + 1),
    "num_kv_heads": lambda s: s.update(num_kv_heads=s["num_kv_heads"] * 2),
    "head_dim": lambda s: s.update(head_dim=s["head_dim"] * 2),
    "block_size": lambda s: s.update(block_size=s["block_size"] * 2),
    "tp_size": lambda s: s.update(tp_size=s["tp_size"] * s["num_kv_heads"]),
    "tp_rank": lambda s: s.update(tp_size=s["tp_size"] * s["num_kv_heads"], tp_rank=1),
    "latent": lambda s: s.update(latent=not s["latent"]),
}


def rewrite_begin(meta: dict[str, Any], field: str) -> dict[str, Any]:
    """A TRANSFER_BEGIN map whose spec differs in ``field``, otherwise well formed (fingerprint, token
    and layer ranges consistent with the new spec), so the receiver refuses it by field."""
    t = dict(meta["transfer"])
    spec = dict(t["spec"])
    SPEC_CHANGES[field](spec)
    new = KVSpec.from_dict(spec)
    t["spec"], t["fingerprint"] = new.as_dict(), new.fingerprint
    start = t["token_range"][0]
    t["token_range"] = [start, start + len(t["block_keys"]) * new.block_size]
    lo, hi = t["layer_range"]
    t["layer_range"] = [min(lo, new.num_layers - 1), min(hi, new.num_layers)]
    return {**meta, "transfer": t}


class _Armed:
    def __init__(self, cmd: dict[str, Any]) -> None:
        self.action = str(cmd["action"])
        self.mtype = int(cmd.get("type", MsgType.LAYER))
        self.nth = max(1, int(cmd.get("nth", 1)))
        self.field = str(cmd.get("field", ""))
        self.bps = float(cmd.get("bps", 0.0))
        self.seen = 0


class Proxy:
    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], plain: bool) -> None:
        self.upstream = upstream
        self.plain = plain
        self.lsock = socket.create_server(listen)
        self.port = self.lsock.getsockname()[1]
        self._lock = threading.Lock()
        self._out = threading.Lock()
        self.armed: _Armed | None = None
        self.throttle_bps = 0.0
        self.release = threading.Event()
        self.conns: list[socket.socket] = []
        self.conn_id = 0
        self.rng = random.Random(7)

    def emit(self, event: str, **kw: Any) -> None:
        with self._out:
            sys.stdout.write(json.dumps({"event": event, **kw}) + "\n")
            sys.stdout.flush()

    # ------------------------------------------------------------------ connections
    def serve(self) -> None:
        while True:
            try:
                down, _ = self.lsock.accept()
            except OSError:
                return
            self.drop_all()
            try:
                up = socket.create_connection(self.upstream, timeout=10)
                up.settimeout(None)
            except OSError as exc:
                down.close()
                self.emit("closed", why=f"upstream {self.upstream}: {exc}")
                continue
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.conns = [down, up]
                self.conn_id += 1
                cid = self.conn_id
            self.emit("accepted", conn=cid)
            fwd = self._pump_plain if self.plain else self._pump_frames
            threading.Thread(target=self._run, args=(fwd, down, up, cid), daemon=True).start()
            threading.Thread(target=self._run, args=(self._pump_plain, up, down, cid), daemon=True).start()

    def _run(self, pump: Callable[[socket.socket, socket.socket], None], src: socket.socket,
             dst: socket.socket, cid: int) -> None:
        why = "eof"
        try:
            pump(src, dst)
        except (OSError, KVPortError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.release.set()  # a held stream of a dead link does not wait
        self.emit("closed", conn=cid, why=why)

    def drop_all(self) -> None:
        with self._lock:
            conns, self.conns = self.conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    # ------------------------------------------------------------------ pumps
    def _send(self, dst: socket.socket, data: memoryview | bytes) -> None:
        mv = memoryview(data)
        bps = self.throttle_bps
        if bps <= 0:
            dst.sendall(mv)
            return
        for i in range(0, mv.nbytes, _PIECE):
            piece = mv[i : i + _PIECE]
            dst.sendall(piece)
            time.sleep(piece.nbytes / bps)

    def _pump_plain(self, src: socket.socket, dst: socket.socket) -> None:
        buf = memoryview(bytearray(1 << 20))
        while True:
            n = src.recv_into(buf)
            if n == 0:
                return
            self._send(dst, buf[:n])

    def _pump_frames(self, src: socket.socket, dst: socket.socket) -> None:
        head = bytearray(HEADER_BYTES)
        while True:
            if not _read_exact(src, memoryview(head)):
                return
            hdr = decode_header(head, _LIMITS)
            body = bytearray(hdr.meta_len + hdr.wire_payload_bytes)
            if body and not _read_exact(src, memoryview(body)):
                raise ProtocolError("the client closed inside a frame")
            act = self._match(int(hdr.msg_type))
            frame = bytes(head) + bytes(body)
            if act is None:
                self._send(dst, frame)
            elif act.action == "drop":
                self.emit("injected", action="drop", detail=f"{hdr.msg_type.name} #{act.nth}")
            elif act.action == "dup":
                self._send(dst, frame)
                self._send(dst, frame)
                self.emit("injected", action="dup", detail=f"{hdr.msg_type.name} #{act.nth}")
            elif act.action == "flip":
                self._send(dst, self._flip(hdr.meta_len, hdr.chunk_size, hdr.n_chunks, frame))
            elif act.action == "spec":
                self._send(dst, self._respec(hdr, body, act.field))
            elif act.action == "hold":
                self.release.clear()
                self.emit("held", detail=f"{hdr.msg_type.name} #{act.nth}")
                self.release.wait()
                self._send(dst, frame)
            else:
                self._send(dst, frame)

    def _match(self, mtype: int) -> _Armed | None:
        with self._lock:
            a = self.armed
            if a is None or a.action == "throttle" or a.mtype != mtype:
                return None
            a.seen += 1
            if a.seen < a.nth:
                return None
            self.armed = None  # one shot
            return a

    def _flip(self, meta_len: int, chunk: int, n_chunks: int, frame: bytes) -> bytes:
        if n_chunks == 0:
            self.emit("injected", action="flip", detail="no payload: forwarded as is")
            return frame
        out = bytearray(frame)
        c = self.rng.randrange(n_chunks)
        start = HEADER_BYTES + meta_len + c * (chunk + CHECKSUM_BYTES)
        size = min(chunk, len(out) - start - CHECKSUM_BYTES)
        at = start + self.rng.randrange(size)
        out[at] ^= 1 << self.rng.randrange(8)
        self.emit("injected", action="flip", detail=f"chunk {c}, byte {at - start}")
        return bytes(out)

    def _respec(self, hdr: Any, body: bytearray, field: str) -> bytes:
        meta = msgpack.unpackb(bytes(body[: hdr.meta_len]), raw=False, strict_map_key=False)
        new_meta = msgpack.packb(rewrite_begin(meta, field), use_bin_type=True)
        head = encode_header(hdr.msg_type, new_meta, hdr.payload_len, hdr.chunk_size, hdr.flags, hdr.corr_id)
        self.emit("injected", action="spec", detail=field)
        return head + bytes(body[hdr.meta_len :])

    # ------------------------------------------------------------------ control
    def command(self, cmd: dict[str, Any]) -> bool:
        op = cmd.get("cmd")
        if op == "arm":
            a = _Armed(cmd)
            with self._lock:
                self.armed = a
                self.throttle_bps = a.bps if a.action == "throttle" else 0.0
        elif op == "disarm":
            with self._lock:
                self.armed, self.throttle_bps = None, 0.0
            self.release.set()
        elif op == "release":
            self.release.set()
        elif op == "upstream":
            self.upstream = (str(cmd["host"]), int(cmd["port"]))
        elif op == "close":
            self.drop_all()
        elif op == "quit":
            return False
        self.emit("ok", cmd=str(op))
        return True


def _read_exact(s: socket.socket, mv: memoryview) -> bool:
    """Fill ``mv``; False on EOF before the first byte, ProtocolError on EOF inside it."""
    got = 0
    while got < mv.nbytes:
        n = s.recv_into(mv[got:])
        if n == 0:
            if got == 0:
                return False
            raise ProtocolError(f"EOF after {got} of {mv.nbytes} bytes")
        got += n
    return True


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvport.bench.faults.proxy")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--plain", action="store_true")
    args = ap.parse_args(argv)
    p = Proxy(_addr(args.listen), _addr(args.upstream), args.plain)
    threading.Thread(target=p.serve, daemon=True).start()
    p.emit("listening", port=p.port)
    for line in sys.stdin:
        try:
            if not p.command(json.loads(line)):
                break
        except (ValueError, KeyError, TypeError) as exc:
            p.emit("error", detail=f"{type(exc).__name__}: {exc}")
    p.drop_all()
    p.lsock.close()


if __name__ == "__main__":
    main()
