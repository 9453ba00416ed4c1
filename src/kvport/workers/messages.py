"""Control messages between a router (the demo's, the fault benchmark's) and the workers: msgpack
maps over a pipe (no pickle).

Every message is a map with an ``op`` string; answers carry ``ok`` and either results or ``error``.
Lengths are capped on receipt (``MAX_MESSAGE_BYTES``); token lists travel as int lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from kvport.errors import KVPortError, ProtocolError

MAX_MESSAGE_BYTES = 8 << 20


def send(conn: Connection, msg: dict[str, Any]) -> None:
    conn.send_bytes(msgpack.packb(msg, use_bin_type=True))


def recv(conn: Connection, timeout_s: float | None = None) -> dict[str, Any]:
    if timeout_s is not None and not conn.poll(timeout_s):
        raise ProtocolError(f"no message within {timeout_s} s")
    try:
        raw = conn.recv_bytes(MAX_MESSAGE_BYTES)
    except (EOFError, OSError) as exc:
        raise ProtocolError(f"control pipe closed: {exc!r}") from exc
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ProtocolError(f"malformed control message: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("control message is not a map with an 'op'")
    return msg


Handler = Callable[[dict[str, Any]], dict[str, Any]]


def serve(conn: Connection, handlers: Mapping[str, Handler], close: Callable[[], None]) -> None:
    """A worker's control loop: answer each ``op`` with its handler's map (``ok`` added when missing)
    until ``stop``, which runs ``close`` and answers ``stopped``. A kvport error in a handler is
    answered as ``ok: False`` with the error; the worker keeps serving."""
    while True:
        msg = recv(conn)
        op = msg["op"]
        if op == "stop":
            close()
            send(conn, {"op": "stopped", "ok": True})
            return
        handler = handlers.get(op)
        if handler is None:
            send(conn, {"op": op, "ok": False, "error": f"unknown op {op!r}"})
            continue
        try:
            send(conn, {"ok": True, **handler(msg)})
        except KVPortError as exc:
            send(conn, {"op": op, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
