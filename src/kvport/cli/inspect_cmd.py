"""``kvport inspect --server HOST:PORT``: usage, tenants, top prefixes, pins and leases of a server."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from kvport.cli.serve_cmd import parse_listen
from kvport.config import Settings
from kvport.server.client import RemoteTier
from kvport.server.pool import ClientConfig
from kvport.units import format_bytes


def _render(s: dict[str, Any]) -> None:
    con = Console()
    srv = s["server"]
    con.print(f"host {format_bytes(srv['host_used'])} / {format_bytes(srv['host_capacity'])}   "
              f"disk {format_bytes(srv['disk_used'])} / {format_bytes(srv['disk_capacity'])}   "
              f"blocks {srv['blocks']}   connections {srv['connections']}   "
              f"staging {format_bytes(srv['staging_bytes'])}   uptime {srv['uptime_s']:.0f} s"
              + ("   DRAINING" if srv["draining"] else ""))
    t = Table("tenant", "bytes", "blocks", "quota", "connections", title="tenants")
    for row in s["tenants"]:
        t.add_row(row["name"], format_bytes(row["bytes"]), str(row["blocks"]),
                  "-" if row["quota"] is None else format_bytes(row["quota"]), str(row["connections"]))
    con.print(t)
    t = Table("tenant", "prefix (last block key)", "hits", "bytes", "place", title="top prefixes")
    for row in s["top_prefixes"]:
        t.add_row(row["tenant"], row["key"], str(row["hits"]), format_bytes(row["bytes"]), row["place"])
    con.print(t)
    t = Table("tenant", "key", "pins", title="pins")
    for row in s["pins"]:
        t.add_row(row["tenant"], row["key"], str(row["pins"]))
    con.print(t)
    t = Table("lease", "tenant", "blocks", "expires in (s)", title="leases")
    for row in s["leases"]:
        t.add_row(str(row["lease"]), row["tenant"], str(row["blocks"]), f"{row['expires_in_s']:.1f}")
    con.print(t)


@click.command(name="inspect")
@click.option("--server", "server", required=True, help="HOST:PORT of a running kvport server")
@click.option("--tenant", default="default", show_default=True)
@click.option("--token", default=None, help="tenant token (default: KVPORT_AUTH_TOKEN)")
@click.option("--tls", is_flag=True, help="connect with TLS")
@click.option("--tls-ca", default=None, type=click.Path(dir_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="print the raw JSON")
def inspect_cmd(server: str, tenant: str, token: str | None, tls: bool, tls_ca: str | None, as_json: bool) -> None:
    """Show a running server's usage, tenants, top prefixes, pins and leases."""
    from pathlib import Path

    host, port = parse_listen(server)
    cfg = ClientConfig(host=host, port=port, tenant=tenant, token=token or Settings.from_env().auth_token,
                       tls=tls, tls_ca=Path(tls_ca) if tls_ca else None, pool_size=1, retries=1)
    tier = RemoteTier(cfg)
    try:
        stats = tier.stats()
    finally:
        tier.close()
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        _render(stats)


