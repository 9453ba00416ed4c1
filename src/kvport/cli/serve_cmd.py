"""``kvport serve``: run the shared KV tier server until SIGTERM/SIGINT (graceful drain).

``python -m kvport.cli.serve_cmd ARGS`` runs the same command without importing the rest of the
CLI (some commands import torch, seconds of start-up a server does not need): tests, the
benchmark and process supervisors start servers this way.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from kvport.cli._fileopts import config_option, file_config, serve_defaults
from kvport.cli._params import as_seconds, as_size
from kvport.cli._run import run_click, setup_logging
from kvport.errors import ConfigError, UserInputError
from kvport.server.admission import parse_networks
from kvport.server.app import DEFAULT_IO_THREADS, ServerConfig, serve
from kvport.server.limits import ServerLimits
from kvport.server.tenants import Tenant
from kvport.store.eviction import DEFAULT_POLICY, POLICIES


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserInputError(f"{flag} expects HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@click.command(name="serve")
@config_option(serve_defaults, role="server")
@click.option("--listen", default="127.0.0.1:7878", show_default=True, help="HOST:PORT (port 0: any free port)")
@click.option("--capacity", default="8GiB", show_default=True, callback=as_size, metavar="SIZE",
              help="memory budget of the whole server process")
@click.option("--disk", "disk_dir", default=None, type=click.Path(file_okay=False), help="disk tier folder")
@click.option("--disk-capacity", default=None, callback=as_size, metavar="SIZE",
              help="disk tier size (default 4 x capacity); eviction leaves room for the host pool (up to half) "
                   "so that a graceful shutdown can move every host block down")
@click.option("--page-size", default="1MiB", show_default=True, callback=as_size, metavar="SIZE",
              help="host page = wire chunk size")
@click.option("--http-port", default=None, type=click.IntRange(0, 65535),
              help="serve /metrics and /healthz on this port (0: any free port)")
@click.option("--tenants", "tenants_file", default=None, type=click.Path(dir_okay=False, exists=True),
              help="tenants JSON file (names, tokens, quotas); replaces a config file's [[tenants]]")
@click.option("--tls-cert", default=None, type=click.Path(dir_okay=False, exists=True))
@click.option("--tls-key", default=None, type=click.Path(dir_okay=False, exists=True))
@click.option("--max-value", default="64MiB", show_default=True, callback=as_size, metavar="SIZE",
              help="largest value one PUT may carry")
@click.option("--inflight", default="256MiB", show_default=True, callback=as_size, metavar="SIZE",
              help="staging budget for values in flight")
@click.option("--idle-timeout", default=120.0, show_default=True, type=float, callback=as_seconds, help="seconds")
@click.option("--frame-timeout", default=30.0, show_default=True, type=float, callback=as_seconds,
              help="seconds a started frame (and its answer) may take")
@click.option("--write-timeout", default=10.0, show_default=True, type=float, callback=as_seconds,
              help="seconds an answer may wait without the peer taking a byte (then the connection is cut)")
@click.option("--handshake-timeout", default=5.0, show_default=True, type=float, callback=as_seconds,
              help="seconds from accept to login (TLS and kvport handshakes)")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1),
              help="connections open at once, logged in or not")
@click.option("--max-pending", default=64, show_default=True, type=click.IntRange(1),
              help="connections not logged in yet (the oldest attempt of the busiest peer gives way to a new one)")
@click.option("--max-per-peer", default=256, show_default=True, type=click.IntRange(0),
              help="connections per peer address (0: no cap)")
@click.option("--per-peer-exempt", default="127.0.0.0/8,::1/128", show_default=True, metavar="CIDRS",
              help="comma-separated networks --max-per-peer does not apply to ('' for none)")
@click.option("--eviction", default=DEFAULT_POLICY, show_default=True, type=click.Choice(sorted(POLICIES)),
              help="eviction policy of the host and disk tiers (kvport.store.eviction)")
@click.option("--no-spill", is_flag=True, help="on shutdown, do not move host blocks to disk")
@click.option("--prefault/--no-prefault", default=False, show_default=True,
              help="fault the whole host pool in at start (resident from the first second, no page faults on "
                   "puts); --no-prefault: the pool becomes resident as it fills")
@click.option("--io-threads", default=DEFAULT_IO_THREADS, show_default=True, type=click.IntRange(0, 64),
              help="threads that move large payloads (0: all I/O on the event loop thread)")
def serve_cmd(listen: str, capacity: int, disk_dir: str | None, disk_capacity: int | None, page_size: int,
              http_port: int | None, tenants_file: str | None, tls_cert: str | None, tls_key: str | None,
              max_value: int, inflight: int, idle_timeout: float, frame_timeout: float, write_timeout: float,
              handshake_timeout: float, max_connections: int, max_pending: int, max_per_peer: int,
              per_peer_exempt: str, eviction: str, no_spill: bool, prefault: bool,
              io_threads: int) -> None:
    """Serve a shared KV tier (host + disk) over the kvport wire format.

    With ``--config FILE`` the file's [server], [limits], [eviction], [lifetimes] and [[tenants]] apply;
    a flag given here overrides its key, a ``KVPORT_*`` variable overrides the file."""
    kv = file_config()
    host, port = parse_listen(listen)
    if disk_dir is not None and not disk_dir.strip():
        raise click.BadParameter("an empty path (leave --disk out for a server without a disk tier)",
                                 param_hint="'--disk'")
    if disk_capacity is not None and disk_dir is None:
        raise click.BadParameter("sizes the disk tier: give --disk FOLDER too", param_hint="'--disk-capacity'")
    exempt = tuple(c.strip() for c in per_peer_exempt.split(",") if c.strip())
    try:
        parse_networks(exempt)
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix("--per-peer-exempt: "), param_hint="'--per-peer-exempt'") \
            from exc
    limits = ServerLimits(max_value_bytes=max_value, total_inflight_bytes=inflight,
                          idle_timeout_s=idle_timeout, frame_timeout_s=frame_timeout, write_timeout_s=write_timeout,
                          handshake_timeout_s=handshake_timeout, max_connections=max_connections,
                          max_pending=max_pending, max_per_peer=max_per_peer, per_peer_exempt=exempt,
                          request_ttl_s=kv.lifetimes.request_ttl_s, session_ttl_s=kv.lifetimes.session_ttl_s)
    tenants = None if kv.tenants is None or tenants_file is not None else \
        tuple(Tenant(t.name, t.token.encode() if t.token else None, t.quota_bytes, t.admin) for t in kv.tenants)
    cfg = ServerConfig(
        host=host, port=port, capacity_bytes=capacity, disk_dir=Path(disk_dir) if disk_dir else None,
        disk_capacity_bytes=disk_capacity, page_bytes=page_size,
        http_port=http_port, tenants_file=Path(tenants_file) if tenants_file else None,
        tenants=tenants, auth_token=kv.server.auth_token, eviction=eviction,
        tls_cert=Path(tls_cert) if tls_cert else None, tls_key=Path(tls_key) if tls_key else None, limits=limits,
        spill_on_shutdown=not no_spill,
        io_threads=io_threads, prefault=prefault)
    asyncio.run(serve(cfg))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvport.cli.serve_cmd``: the server without importing the other commands."""
    setup_logging()
    return run_click(serve_cmd, argv, "kvport serve")


if __name__ == "__main__":
    sys.exit(main())
