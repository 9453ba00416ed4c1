"""The kvport server process: configuration, listening, the tick, graceful shutdown.

Memory: ``capacity_bytes`` is the whole process's budget, not just the host pool::

    capacity = resident baseline (interpreter, libraries, measured at start)
             + staging pool (limits.total_inflight_bytes: values bound for or read from disk)
             + lease and pin records (server.held.held_budget: at most capacity / 8, less when
               every tenant at its cap needs less; charged before a record is made)
             + scratch (1 MiB) + host pool (the rest, mapped once)

The host pool is resident as it fills (an idle server holds its baseline, not its capacity), or from
the start with ``prefault`` (``kvport serve --prefault``): the pages fault in once either way, at
start or in the copies of the puts that first reach them. A capacity over what the machine has
available is logged at start (without ``prefault`` such a server would be killed by the kernel when
it fills, not refused when it starts).

Storage is one :class:`~kvport.store.TieredStore` plus its ledger (:mod:`kvport.server.storage`):
the server keeps no pins, leases, quotas or placement of its own.

Shutdown on SIGTERM/SIGINT: stop accepting; ``/healthz`` turns 503; idle connections are closed;
a connection in the middle of a request finishes it (PUTs are refused from now on with
SHUTTING_DOWN) within ``drain_timeout_s``; then every host block the disk can take is demoted to
it (a block that does not fit stays behind; the rest go on), the journal is fsynced and the tiers
closed. A restart with the same ``--disk`` finds those blocks again, with their parents, lifetimes
and tenants (same server secret, so the same tenant-salted keys). One server per ``--disk``: the
folder is locked while a server runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import signal
import socket
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvport.config import MIN_TOKEN_CHARS
from kvport.errors import ConfigError, PeerError, TierError
from kvport.protocol.aio import AsyncStream, BulkIO, SockStream, TlsStream
from kvport.protocol.net import is_loopback, tune
from kvport.server.connection import Connection, ConnState
from kvport.server.handlers import Handlers
from kvport.server.held import held_budget
from kvport.server.http import HttpEndpoint
from kvport.server.limits import ServerLimits
from kvport.server.metrics import ServerMetrics
from kvport.server.staging import size_class
from kvport.server.state import ServerState
from kvport.server.storage import DISK, HOST, host_pool_bytes, open_storage
from kvport.server.tenants import Tenant, TenantTable, load_or_create_secret, load_tenants
from kvport.store import TieredStore
from kvport.store.eviction import DEFAULT_POLICY

log = logging.getLogger(__name__)
MiB = 1 << 20
DEFAULT_IO_THREADS = 4  # bench server on 2 cores: 1 -> 2.3, 2 -> 2.5-2.6, 4 -> 2.5-2.7 GB/s


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    capacity_bytes: int = 8 << 30
    disk_dir: Path | None = None
    disk_capacity_bytes: int | None = None  # None: 4 x capacity
    page_bytes: int = 1 * MiB
    http_port: int | None = None
    tenants_file: Path | None = None
    tenants: tuple[Tenant, ...] | None = None  # given as values (a config file's [[tenants]]), not a tenants file
    auth_token: str | None = field(default=None, repr=False)  # token of the default tenant (no tenants file)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    spill_on_shutdown: bool = True
    eviction: str = DEFAULT_POLICY  # a name of kvport.store.eviction.POLICIES
    drain_timeout_s: float = 10.0
    io_threads: int = DEFAULT_IO_THREADS  # bulk payload I/O threads (0: every byte on the event loop thread)
    prefault: bool = False  # fault the host pool in at start (else it grows resident as it fills)

    def __post_init__(self) -> None:
        if self.tenants is not None and self.tenants_file is not None:
            raise ConfigError("tenants come from a tenants file or as values, not both")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.page_bytes < 4096 or self.page_bytes & (self.page_bytes - 1):
            raise ConfigError("page size must be a power of two of at least 4 KiB")
        if size_class(self.limits.max_value_bytes) > self.limits.total_inflight_bytes:
            # staging buffers come in power-of-two classes: a value of max_value_bytes takes one such
            # class, which must fit the in-flight budget, or that value would answer "busy" forever
            raise ConfigError(f"--inflight {self.limits.total_inflight_bytes} must hold a staging buffer for the "
                              f"largest value: at least {size_class(self.limits.max_value_bytes)} bytes "
                              f"(--max-value {self.limits.max_value_bytes} rounded up to a power of two)")
        if not 0 <= self.io_threads <= 64:
            raise ConfigError(f"io threads must be 0..64, got {self.io_threads}")
        if self.capacity_bytes <= 0:
            raise ConfigError(f"--capacity must be positive, got {self.capacity_bytes}")
        if self.disk_capacity_bytes is not None and self.disk_capacity_bytes < self.page_bytes:
            raise ConfigError(f"--disk-capacity {self.disk_capacity_bytes} must hold at least one page "
                              f"(--page-size {self.page_bytes} bytes)")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ConfigError(f"--http-port must be 0..65535, got {self.http_port}")
        if (self.tenants_file is None and self.auth_token is not None and len(self.auth_token) < MIN_TOKEN_CHARS
                and not is_loopback(self.host)):
            raise ConfigError(f"KVPORT_AUTH_TOKEN is shorter than {MIN_TOKEN_CHARS} characters: listening on "
                              f"{self.host!r} (beyond loopback) requires a token of at least {MIN_TOKEN_CHARS}")


def _tls_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate/key: {exc}") from exc
    return ctx


class KVServer:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.port = 0
        self.http_port: int | None = None
        self._ids = itertools.count(1)
        self._tasks: dict[int, tuple[asyncio.Task[None], Connection]] = {}
        self._accept: asyncio.Task[None] | None = None
        self._tls: ssl.SSLContext | None = None
        self._tick: asyncio.Task[None] | None = None
        self._http: HttpEndpoint | None = None
        self._lsock: socket.socket | None = None
        self._io = BulkIO(0)

    async def start(self) -> None:
        """Bind, open and start everything, or (ConfigError) leave nothing behind: a start that fails
        half-way closes what it opened (listeners, I/O threads, tiers, the disk folder's lock)."""
        cfg = self.cfg
        tenants_list = list(cfg.tenants) if cfg.tenants is not None else load_tenants(cfg.tenants_file, cfg.auth_token)
        try:  # the secret lives in the disk folder (created here when missing)
            secret = load_or_create_secret(cfg.disk_dir) if cfg.disk_dir else secrets.token_bytes(32)
        except ConfigError as exc:  # missing parent, read-only, not a folder
            raise ConfigError(f"--disk {cfg.disk_dir}: {exc}") from exc
        tenants = TenantTable(tenants_list, secret)
        if not is_loopback(cfg.host) and not tenants.all_have_tokens():
            raise ConfigError(f"listening on {cfg.host!r} (beyond loopback) requires a token for every tenant")
        tls = _tls_context(cfg)
        held_bytes = held_budget(cfg.capacity_bytes, len(tenants.names()), cfg.limits.max_held_per_tenant)
        host_bytes = host_pool_bytes(cfg.capacity_bytes - held_bytes, cfg.limits.total_inflight_bytes, cfg.page_bytes)
        disk_bytes = 4 * cfg.capacity_bytes if cfg.disk_capacity_bytes is None else cfg.disk_capacity_bytes
        store = open_storage(host_bytes, cfg.page_bytes, cfg.disk_dir, disk_bytes, tenants.quotas(),
                             cfg.limits.max_value_bytes, eviction=cfg.eviction, prefault=cfg.prefault)
        try:
            self.state = ServerState(store, tenants, cfg.limits, ServerMetrics(), cfg.page_bytes, held_bytes)
            self.handlers = Handlers(self.state)
            self._io = BulkIO(cfg.io_threads)
            try:
                self._lsock = socket.create_server((cfg.host, cfg.port), backlog=256)
            except (OSError, OverflowError) as exc:
                raise ConfigError(f"--listen: cannot listen on {cfg.host}:{cfg.port}: {exc}") from exc
            self.port = int(self._lsock.getsockname()[1])
            self._tls = tls
            self._lsock.setblocking(False)
            self._accept = asyncio.create_task(self._accept_loop(self._lsock))
            if cfg.http_port is not None:
                self._http = HttpEndpoint(cfg.host, cfg.http_port, lambda: not self.state.draining, self.state.tick)
                self.http_port = await self._http.start()
        except BaseException:
            await self._undo_start(store)
            raise
        self._tick = asyncio.create_task(self._ticker())

    async def _undo_start(self, store: TieredStore) -> None:
        """Close what a failed :meth:`start` opened, in the order :meth:`shutdown` does."""
        if self._accept is not None:
            self._accept.cancel()
        if self._lsock is not None:
            self._lsock.close()
        self._io.close()
        if self._http is not None:
            await self._http.close()
        _close_store(store)

    # ------------------------------------------------------------ connections
    async def _accept_loop(self, lsock: socket.socket) -> None:
        """Every connection, plain or TLS, is counted from here (:mod:`kvport.server.admission`):
        the TLS handshake runs in the connection's task, under its login deadline."""
        loop = asyncio.get_running_loop()
        limits = self.cfg.limits
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            cid = next(self._ids)
            decision = self.state.admission.admit(cid, str(addr[0]), self.state.draining)
            if decision.gave_way is not None:
                self.state.metrics.refused.labels("gave_way").inc()
                gone = self._tasks.get(decision.gave_way)
                if gone is not None:
                    gone[0].cancel()  # its finally closes the stream
            if not decision.admit:
                self.state.metrics.refused.labels(decision.refused or "full").inc()
                with contextlib.suppress(OSError):
                    sock.close()
                continue
            peer = f"{addr[0]}:{addr[1]}"
            try:
                tune(sock)
            except OSError as exc:  # the peer already went away
                log.debug("tuning %s: %s", peer, exc)
            stream: AsyncStream = SockStream(sock, peer, self._io, limits.write_timeout_s) if self._tls is None else \
                TlsStream(sock, self._tls, peer, limits.write_timeout_s, limits.handshake_timeout_s)
            conn = Connection(cid, stream, self.state, self.handlers.dispatch)
            self._track(asyncio.create_task(conn.run()), conn)
            self.state.metrics.pending.set(self.state.admission.pending)

    def _track(self, task: asyncio.Task[None], conn: Connection) -> None:
        cid = conn.id
        self._tasks[cid] = (task, conn)

        def done(_t: asyncio.Task[None]) -> None:
            self._tasks.pop(cid, None)
            conn.close()  # a task cancelled before its first step never ran its own finally

        task.add_done_callback(done)

    async def _ticker(self) -> None:
        while True:
            self.state.tick()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------ shutdown
    async def shutdown(self) -> None:
        self.state.draining = True
        if self._accept is not None:
            self._accept.cancel()
        if self._lsock is not None:
            self._lsock.close()
        for task, conn in list(self._tasks.values()):
            if conn.state is not ConnState.BUSY:
                task.cancel()
        pending = [t for t, _ in self._tasks.values()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.cfg.drain_timeout_s)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        if self._tick is not None:
            self._tick.cancel()
        self._io.close()  # every connection task has ended: no worker holds a socket
        if self._http is not None:
            await self._http.close()
        store = self.state.store
        if self.cfg.spill_on_shutdown and DISK in store.tiers:
            moved, stayed = store.spill(HOST)
            log.info("spilled %d host blocks to disk (%d stayed: no room)", moved, stayed)
        _close_store(store)


def _close_store(store: TieredStore) -> None:
    for tier in store.tiers.values():
        try:
            tier.close()
        except TierError as exc:
            log.warning("closing %s: %s", tier.name, exc)
    store.close()


async def serve(cfg: ServerConfig, announce: bool = True) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    server = KVServer(cfg)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if announce:
        tiers = server.state.store.tiers
        print(json.dumps({"event": "listening", "host": cfg.host, "port": server.port, "http_port": server.http_port,
                          "page_bytes": cfg.page_bytes, "host_capacity": tiers[HOST].capacity_bytes,
                          "prefault": cfg.prefault,
                          "disk_capacity": tiers[DISK].capacity_bytes if DISK in tiers else 0}), flush=True)
    await stop.wait()
    with contextlib.suppress(PeerError):
        await server.shutdown()
    if announce:
        print(json.dumps({"event": "stopped"}), flush=True)
    sys.stdout.flush()
