"""Raw sockets against a real server: frames by hand, a login without the client library."""

from __future__ import annotations

import socket
from typing import Any

from kvport.protocol import handshake as hs
from kvport.protocol.frame import HEADER_BYTES, MsgType, decode_frame, decode_header, encode_frame, frame_bytes


def recv_frame(s: socket.socket) -> tuple[MsgType, dict[str, Any]]:
    head = recv_exact(s, HEADER_BYTES)
    hdr = decode_header(head)
    rest = recv_exact(s, hdr.meta_len + hdr.wire_payload_bytes)
    f = decode_frame(head + rest)
    return f.msg_type, f.meta


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise ConnectionError("closed")
        buf += part
    return buf


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True when the server closes the connection (EOF or reset) within ``seconds``."""
    s.settimeout(seconds)
    try:
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def connect(port: int, host: str = "127.0.0.1", rcvbuf: int | None = None, timeout: float = 10.0) -> socket.socket:
    """A plain TCP connection (``rcvbuf``: a small receive buffer, set before connecting)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect((host, port))
    return s


def login(s: socket.socket, tenant: str = "default", token: bytes | None = None, client: str = "raw-test") -> None:
    mt, meta = recv_frame(s)
    assert mt is MsgType.AUTH_CHALLENGE
    nonce_c = bytes(32)
    answer = hs.Response(nonce_c, tenant, client, hs.client_mac(token, meta["nonce_s"], nonce_c, tenant))
    s.sendall(frame_bytes(encode_frame(MsgType.AUTH_RESPONSE, answer.to_meta())))
    mt, _ = recv_frame(s)
    assert mt is MsgType.AUTH_OK


def authed_socket(port: int, tenant: str = "default", token: bytes | None = None,
                  rcvbuf: int | None = None) -> socket.socket:
    s = connect(port, rcvbuf=rcvbuf)
    login(s, tenant, token)
    return s
