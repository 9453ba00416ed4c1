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

from kvport.cli._run import run_click, setup_logging
from kvport.config import Settings
from kvport.errors import UserInputError
from kvport.server.app import DEFAULT_IO_THREADS, ServerConfig, serve
from kvport.server.limits import ServerLimits
from kvport.units import parse_size


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserInputError(f"--listen expects HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@click.command(name="serve")
@click.option("--listen", default="127.0.0.1:7878", show_default=True, help="HOST:PORT (port 0: any free port)")
@click.option("--capacity", default="8GiB", show_default=True, help="memory budget of the whole server process")
@click.option("--disk", "disk_dir", default=None, type=click.Path(file_okay=False), help="disk tier folder")
@click.option("--disk-capacity", default=None, help="disk tier size (default 4 x capacity)")
@click.option("--page-size", default="1MiB", show_default=True, help="host page = wire chunk size")
@click.option("--http-port", default=None, type=int, help="serve /metrics and /healthz on this port")
@click.option("--tenants", "tenants_file", default=None, type=click.Path(dir_okay=False, exists=True),
              help="tenants JSON file (names, tokens, quotas)")
@click.option("--tls-cert", default=None, type=click.Path(dir_okay=False, exists=True))
@click.option("--tls-key", default=None, type=click.Path(dir_okay=False, exists=True))
@click.option("--max-value", default="64MiB", show_default=True, help="largest value one PUT may carry")
@click.option("--inflight", default="256MiB", show_default=True, help="staging budget for values in flight")
@click.option("--idle-timeout", default=120.0, show_default=True, type=float, help="seconds")
@click.option("--frame-timeout", default=30.0, show_default=True, type=float,
              help="seconds a started frame (and its answer) may take")
@click.option("--no-spill", is_flag=True, help="on shutdown, do not move host blocks to disk")
@click.option("--io-threads", default=DEFAULT_IO_THREADS, show_default=True, type=click.IntRange(0, 64),
              help="threads that move large payloads (0: all I/O on the event loop thread)")
def serve_cmd(listen: str, capacity: str, disk_dir: str | None, disk_capacity: str | None, page_size: str,
              http_port: int | None, tenants_file: str | None, tls_cert: str | None, tls_key: str | None,
              max_value: str, inflight: str, idle_timeout: float, frame_timeout: float, no_spill: bool,
              io_threads: int) -> None:
    """Serve a shared KV tier (host + disk) over the kvport wire format."""
    host, port = parse_listen(listen)
    limits = ServerLimits(max_value_bytes=parse_size(max_value), total_inflight_bytes=parse_size(inflight),
                          idle_timeout_s=idle_timeout, frame_timeout_s=frame_timeout)
    cfg = ServerConfig(
        host=host, port=port, capacity_bytes=parse_size(capacity), disk_dir=Path(disk_dir) if disk_dir else None,
        disk_capacity_bytes=parse_size(disk_capacity) if disk_capacity else None, page_bytes=parse_size(page_size),
        http_port=http_port, tenants_file=Path(tenants_file) if tenants_file else None,
        auth_token=Settings.from_env().auth_token, tls_cert=Path(tls_cert) if tls_cert else None,
        tls_key=Path(tls_key) if tls_key else None, limits=limits, spill_on_shutdown=not no_spill,
        io_threads=io_threads)
    asyncio.run(serve(cfg))




def main(argv: list[str] | None = None) -> int:
    """``python -m kvport.cli.serve_cmd``: the server without importing the other commands."""
    setup_logging()
    return run_click(serve_cmd, argv, "kvport serve")


if __name__ == "__main__":
    sys.exit(main())
