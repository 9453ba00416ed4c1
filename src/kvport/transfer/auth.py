"""Shared-secret HMAC challenge-response (mutual); the secret never crosses the wire.

::

    server -> AUTH_CHALLENGE {nonce_s: 32 random bytes}
    client -> AUTH_RESPONSE  {nonce_c: 32 random bytes, mac: HMAC-SHA256(secret, "c" | nonce_s | nonce_c)}
    server -> AUTH_OK        {mac: HMAC-SHA256(secret, "s" | nonce_c | nonce_s)}     (or ERROR, then close)

Both sides compare with ``hmac.compare_digest``. The direction byte stops a reflected answer.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from kvport.errors import AuthError, KVPortError
from kvport.transfer.framing import FrameIO
from kvport.transfer.transport import Transport
from kvport.transfer.wire import Limits, MsgType

NONCE_BYTES = 32
_AUTH_LIMITS = Limits(max_meta_bytes=1024, max_payload_bytes=1, max_chunk_bytes=1, max_chunks=1)


def client_mac(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, b"c" + nonce_s + nonce_c, hashlib.sha256).digest()


def server_mac(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, b"s" + nonce_c + nonce_s, hashlib.sha256).digest()


def _bin(meta: dict[str, object], key: str) -> bytes:
    v = meta.get(key)
    if not isinstance(v, bytes) or len(v) not in (NONCE_BYTES, 32):
        raise AuthError(f"handshake field {key!r} missing or malformed")
    return v


def server_handshake(t: Transport, secret: bytes) -> None:
    io = FrameIO(t, _AUTH_LIMITS)
    nonce_s = os.urandom(NONCE_BYTES)
    try:
        io.send(MsgType.AUTH_CHALLENGE, {"nonce_s": nonce_s})
        f = io.expect(MsgType.AUTH_RESPONSE)
        nonce_c, mac = _bin(f.meta, "nonce_c"), _bin(f.meta, "mac")
        if not hmac.compare_digest(mac, client_mac(secret, nonce_s, nonce_c)):
            io.send(MsgType.ERROR, {"error": "AuthError", "message": "bad credentials"})
            raise AuthError("client failed the shared-secret handshake")
        io.send(MsgType.AUTH_OK, {"mac": server_mac(secret, nonce_s, nonce_c)})
    except AuthError:
        raise
    except KVPortError as exc:
        raise AuthError(f"handshake failed: {exc}") from exc


def client_handshake(t: Transport, secret: bytes) -> None:
    io = FrameIO(t, _AUTH_LIMITS)
    try:
        f = io.expect(MsgType.AUTH_CHALLENGE)
        nonce_s = _bin(f.meta, "nonce_s")
        nonce_c = os.urandom(NONCE_BYTES)
        io.send(MsgType.AUTH_RESPONSE, {"nonce_c": nonce_c, "mac": client_mac(secret, nonce_s, nonce_c)})
        ok = io.expect(MsgType.AUTH_OK, MsgType.ERROR)
        if ok.msg_type is MsgType.ERROR:
            raise AuthError("server refused the shared-secret handshake")
        if not hmac.compare_digest(_bin(ok.meta, "mac"), server_mac(secret, nonce_s, nonce_c)):
            raise AuthError("server failed to prove it holds the shared secret")
    except AuthError:
        raise
    except KVPortError as exc:
        raise AuthError(f"handshake failed: {exc}") from exc
