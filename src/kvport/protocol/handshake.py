"""The one handshake of every kvport connection: mutual HMAC challenge-response; no secret travels.

::

    server -> AUTH_CHALLENGE {nonce_s: 32 random bytes, auth: "hmac-sha256", server: name, info: {str: int}}
    client -> AUTH_RESPONSE  {nonce_c: 32 random bytes, who: principal, client: instance label,
                              dest: the address the client dialled ("" : unbound),
                              mac: HMAC-SHA256(key, LABEL | "c" | nonce_s | nonce_c | who [| 0 | dest])
                              (b"" without a key)}
    server -> AUTH_OK        {who, mac: HMAC-SHA256(key, LABEL | "s" | nonce_c | nonce_s | who [| 0 | dest])
                              (b"" without a key)}
              | ERROR {AuthError} and close

``who`` names the principal whose key signs: a tenant of a kvport server, or the holder of a
transfer link's shared secret. ``client`` labels one client instance (a process); the server uses
``(who, client)`` as the holder of leases and pins. The key is the tenant's token (server) or the
shared secret (transfer). The direction byte stops a reflected answer, a fresh nonce on each side
makes a recorded answer useless, both sides compare with :func:`hmac.compare_digest`, and an unknown
principal is answered exactly like a wrong key (same work, same message).

**Destination binding.** A server given ``names`` (the addresses it is dialled by) accepts only an
answer whose ``dest``, covered by the MAC, is one of them. A relay -- a listener that gets a client
to dial it and passes the real server's challenge through -- then fails: the client signed the
relay's address, not the server's. The transfer links bind every connection this way
(:mod:`kvport.transfer.links`). A principal without a
key is accepted with an empty mac only; a listener beyond loopback refuses to start with one
(checked where listeners are built).

Sans-I/O: the message classes, the MACs and :class:`ServerSide` below; :func:`client_handshake` /
:func:`server_handshake` drive them over the blocking shell (:class:`~kvport.protocol.sync.FrameIO`), and
:func:`server_handshake_async` over the asyncio shell (:class:`~kvport.protocol.aio.AsyncFrames`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvport.errors import AuthError, KVPortError, PeerError, ProtocolError
from kvport.protocol.errors import error_meta
from kvport.protocol.fields import bytes_field, str_field
from kvport.protocol.frame import Flags, FrameHeader, Limits, MsgType

if TYPE_CHECKING:
    from kvport.protocol.aio import AsyncFrames
    from kvport.protocol.sync import FrameIO

LABEL = b"kvport.auth.v2"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_NAME = 64
MAX_DEST = 300  # an address: HOST:PORT, shm:NAME or nixl:HOST:PORT
MAX_INFO = 16
HANDSHAKE_LIMITS = Limits(max_meta_bytes=1024, max_payload_bytes=1, max_chunk_bytes=1, max_chunks=1)
_DUMMY_KEY = secrets.token_bytes(32)


def _bound(who: str, dest: str) -> bytes:
    return who.encode() + (b"\0" + dest.encode() if dest else b"")


def client_mac(key: bytes | None, nonce_s: bytes, nonce_c: bytes, who: str, dest: str = "") -> bytes:
    if not key:
        return b""
    return hmac.new(key, LABEL + b"c" + nonce_s + nonce_c + _bound(who, dest), hashlib.sha256).digest()


def server_mac(key: bytes | None, nonce_s: bytes, nonce_c: bytes, who: str, dest: str = "") -> bytes:
    if not key:
        return b""
    return hmac.new(key, LABEL + b"s" + nonce_c + nonce_s + _bound(who, dest), hashlib.sha256).digest()


def _nonce(meta: dict[str, Any], name: str) -> bytes:
    v = meta.get(name)
    if not isinstance(v, bytes) or len(v) != NONCE_BYTES:
        raise AuthError(f"handshake field {name!r} missing or malformed")
    return v


@dataclass(frozen=True, slots=True)
class Challenge:
    nonce: bytes
    server: str
    info: dict[str, int] = field(default_factory=dict)  # what the client must know (page size, limits)

    def to_meta(self) -> dict[str, Any]:
        return {"nonce_s": self.nonce, "auth": "hmac-sha256", "server": self.server, "info": self.info}

    @classmethod
    def from_meta(cls, m: dict[str, Any]) -> Challenge:
        info = m.get("info", {})
        if m.get("auth") != "hmac-sha256" or not isinstance(info, dict) or len(info) > MAX_INFO or \
                not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in info.items()):
            raise ProtocolError("malformed AUTH_CHALLENGE")
        return cls(_nonce(m, "nonce_s"), str_field(m, "server", MAX_NAME), dict(info))


@dataclass(frozen=True, slots=True)
class Response:
    nonce: bytes
    who: str
    client: str
    mac: bytes
    dest: str = ""  # the address the client dialled, covered by the mac ("": not bound)

    def to_meta(self) -> dict[str, Any]:
        meta = {"nonce_c": self.nonce, "who": self.who, "client": self.client, "mac": self.mac}
        if self.dest:
            meta["dest"] = self.dest
        return meta

    @classmethod
    def from_meta(cls, m: dict[str, Any]) -> Response:
        dest = str_field(m, "dest", MAX_DEST) if "dest" in m else ""
        return cls(_nonce(m, "nonce_c"), str_field(m, "who", MAX_NAME), str_field(m, "client", MAX_NAME),
                   bytes_field(m, "mac", MAC_BYTES), dest)


@dataclass(frozen=True, slots=True)
class Welcome:
    who: str
    mac: bytes

    def to_meta(self) -> dict[str, Any]:
        return {"who": self.who, "mac": self.mac}

    @classmethod
    def from_meta(cls, m: dict[str, Any]) -> Welcome:
        return cls(str_field(m, "who", MAX_NAME), bytes_field(m, "mac", MAC_BYTES))


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is on the other side once the handshake succeeded."""

    who: str  # the authenticated principal (the client's, on the server side)
    client: str  # the client's instance label (server side) or the server's name (client side)
    info: dict[str, int] = field(default_factory=dict)


# ``keys(who)`` -> (known, key): an unknown principal fails exactly like a wrong key
KeyLookup = Callable[[str], tuple[bool, bytes | None]]


def check_response(keys: KeyLookup, nonce_s: bytes, r: Response,
                   names: frozenset[str] | None = None) -> bytes | None:
    """The principal's key when its answer is right (and, given ``names``, signed for one of them);
    AuthError otherwise (same work, same message, whatever was wrong)."""
    known, key = keys(r.who)
    expected = client_mac(key if known else _DUMMY_KEY, nonce_s, r.nonce, r.who, r.dest)
    ok = hmac.compare_digest(expected, r.mac) if expected else r.mac == b""
    if not (ok and known) or (names is not None and r.dest not in names):
        raise AuthError("authentication failed")
    return key


def check_welcome(key: bytes | None, nonce_s: bytes, nonce_c: bytes, who: str, w: Welcome, dest: str = "") -> None:
    if w.who != who or not hmac.compare_digest(server_mac(key, nonce_s, nonce_c, who, dest), w.mac):
        raise AuthError("server failed to prove it holds the key")


# ---------------------------------------------------------------------- blocking shell
def client_handshake(io: FrameIO, who: str, key: bytes | None, client: str, dest: str = "") -> Peer:
    """Answer the server's challenge (signed for ``dest``, the address dialled, when given); the
    server's name and info once it proved itself."""
    limits, io.limits = io.limits, HANDSHAKE_LIMITS
    try:
        hdr, meta = io.read_head()
        if hdr.msg_type is not MsgType.AUTH_CHALLENGE or hdr.payload_len:
            raise ProtocolError(f"expected AUTH_CHALLENGE, got {hdr.msg_type.name}")
        ch = Challenge.from_meta(meta)
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        answer = Response(nonce_c, who, client, client_mac(key, ch.nonce, nonce_c, who, dest), dest)
        io.send(MsgType.AUTH_RESPONSE, answer.to_meta())
        hdr, meta = io.read_head()
        if hdr.flags & Flags.ERROR or hdr.msg_type is MsgType.ERROR:
            raise AuthError(f"server refused {who!r}: {str(meta.get('message', ''))[:200]}")
        if hdr.msg_type is not MsgType.AUTH_OK or hdr.payload_len:
            raise ProtocolError(f"expected AUTH_OK, got {hdr.msg_type.name}")
        check_welcome(key, ch.nonce, nonce_c, who, Welcome.from_meta(meta), dest)
        return Peer(who, ch.server, ch.info)
    except (AuthError, PeerError):  # refused, or the connection itself failed (not an auth answer)
        raise
    except KVPortError as exc:
        raise AuthError(f"handshake failed: {exc}") from exc
    finally:
        io.limits = limits


@dataclass(slots=True)
class ServerSide:
    """The server's half of the handshake, without I/O: what to send, and what an answer means.

    ``challenge()`` is the first frame; ``answer(hdr, meta)`` checks the client's AUTH_RESPONSE and
    gives the reply frame to send and the peer (or the AuthError to raise once the reply is sent)."""

    server: str
    keys: KeyLookup
    info: dict[str, int] = field(default_factory=dict)
    names: frozenset[str] | None = None  # the addresses this server is dialled by (None: unbound answers too)
    nonce: bytes = field(default_factory=lambda: secrets.token_bytes(NONCE_BYTES))

    def challenge(self) -> dict[str, Any]:
        return Challenge(self.nonce, self.server, self.info).to_meta()

    def answer(self, hdr: FrameHeader, meta: dict[str, Any]) -> tuple[MsgType, dict[str, Any], Flags,
                                                                        Peer | AuthError]:
        if hdr.msg_type is not MsgType.AUTH_RESPONSE or hdr.payload_len:
            raise ProtocolError(f"expected AUTH_RESPONSE, got {hdr.msg_type.name}")
        r = Response.from_meta(meta)
        try:
            key = check_response(self.keys, self.nonce, r, self.names)
        except AuthError as exc:
            return MsgType.ERROR, error_meta(exc), Flags.RESPONSE | Flags.ERROR, exc
        welcome = Welcome(r.who, server_mac(key, self.nonce, r.nonce, r.who, r.dest))
        return MsgType.AUTH_OK, welcome.to_meta(), Flags.RESPONSE, Peer(r.who, r.client)


def server_handshake(io: FrameIO, server: str, keys: KeyLookup, info: dict[str, int] | None = None,
                     names: frozenset[str] | None = None) -> Peer:
    """Challenge the client; the authenticated principal, or AuthError (after telling the client).
    ``names``: accept only answers signed for one of these addresses (destination binding)."""
    limits, io.limits = io.limits, HANDSHAKE_LIMITS
    side = ServerSide(server, keys, info or {}, names)
    try:
        io.send(MsgType.AUTH_CHALLENGE, side.challenge())
        hdr, meta = io.read_head()
        mtype, reply, flags, outcome = side.answer(hdr, meta)
        io.send(mtype, reply, flags=flags, corr_id=hdr.corr_id)
        if isinstance(outcome, AuthError):
            raise outcome
        return outcome
    except (AuthError, PeerError):  # refused, or the connection itself failed (not an auth answer)
        raise
    except KVPortError as exc:
        raise AuthError(f"handshake failed: {exc}") from exc
    finally:
        io.limits = limits


# ---------------------------------------------------------------------- asyncio shell
async def server_handshake_async(frames: AsyncFrames, server: str, keys: KeyLookup,
                                  info: dict[str, int] | None = None) -> Peer:
    """:func:`server_handshake` on the server's event loop (the caller bounds it with a deadline)."""
    limits, frames.limits = frames.limits, HANDSHAKE_LIMITS
    side = ServerSide(server, keys, info or {})
    try:
        await frames.send(MsgType.AUTH_CHALLENGE, side.challenge())
        await frames.wait_frame()
        hdr = await frames.read_header()
        meta = await frames.read_meta(hdr)
        mtype, reply, flags, outcome = side.answer(hdr, meta)
        await frames.send(mtype, reply, flags=flags, corr_id=hdr.corr_id)
        if isinstance(outcome, AuthError):
            raise outcome
        return outcome
    finally:
        frames.limits = limits
