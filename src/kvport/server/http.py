"""A tiny asyncio HTTP/1.0 endpoint: ``GET /metrics`` (Prometheus text) and ``GET /healthz``.

Requests are capped (8 KiB of request head, 5 s to send it) and answered with ``Connection:
close``; anything but GET of those two paths is 404/405. ``/healthz`` answers 200 ``ok`` while the
server accepts work and 503 ``draining`` during a graceful shutdown.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

from kvport.errors import ConfigError
from kvport.metrics import exposition

_MAX_HEAD = 8 << 10
_HEAD_TIMEOUT_S = 5.0


def _response(status: str, body: bytes, ctype: str = "text/plain; charset=utf-8") -> bytes:
    head = f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


def route(request_line: bytes, healthy: bool, refresh: Callable[[], None]) -> bytes:
    parts = request_line.decode("latin-1").split()
    if len(parts) < 2:
        return _response("400 Bad Request", b"bad request\n")
    method, path = parts[0], parts[1].split("?", 1)[0]
    if path not in ("/metrics", "/healthz"):
        return _response("404 Not Found", b"not found\n")
    if method != "GET":
        return _response("405 Method Not Allowed", b"GET only\n")
    if path == "/healthz":
        return _response("200 OK", b"ok\n") if healthy else _response("503 Service Unavailable", b"draining\n")
    refresh()
    return _response("200 OK", exposition(), "text/plain; version=0.0.4; charset=utf-8")


class HttpEndpoint:
    def __init__(self, host: str, port: int, healthy: Callable[[], bool], refresh: Callable[[], None]) -> None:
        self.host = host
        self.port = port
        self._healthy = healthy
        self._refresh = refresh
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; a port that cannot be bound (in use, privileged, out of range) is a ConfigError."""
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=_MAX_HEAD)
        except (OSError, OverflowError) as exc:
            errno = exc.errno if isinstance(exc, OSError) and not isinstance(exc, socket.gaierror) else None
            reason = os.strerror(errno) if errno else str(exc)  # "Address already in use", not asyncio's prose
            raise ConfigError(f"--http-port {self.port}: cannot listen on {self.host}:{self.port}: {reason}") from exc
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            writer.write(route(head.split(b"\r\n", 1)[0], self._healthy(), self._refresh))
            async with asyncio.timeout(_HEAD_TIMEOUT_S):
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
