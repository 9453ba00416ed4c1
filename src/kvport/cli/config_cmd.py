"""``kvport config check FILE``: read a config file as every entry point would, start nothing.

Prints ``OK`` and what the file sets up, or one line per problem on stderr and exits 2::

    kvport.toml:3: server.capacity: unknown size unit 'gigs' in '8 gigs': expected one of B, kB, ...
    kvport.toml:8: tiers.dsk: unknown key (did you mean 'disk'?)
    kvport config check: 2 problems in kvport.toml
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import click

from kvport.config import environ
from kvport.configfile import KEYS, ROLES, ConfigFileError, KVPortConfig, env_name, join_address, load_config
from kvport.units import format_bytes


def redact_url(url: str) -> str:
    """A URL as it may be printed: its password (``redis://user:PASS@host``) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))

@click.group(name="config")
def config_group() -> None:
    """The kvport config file (TOML): docs/kvport.example.toml shows every key."""


@config_group.command(name="check")
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@click.option("--no-env", is_flag=True, help="leave out the KVPORT_* variables that override the file's keys")
@click.option("--role", default="all", show_default=True, type=click.Choice(ROLES),
              help="check as kvport serve reads it (server: its tokens, TLS files, RAM, disk), as an engine's "
                   "connector or the demo does (engine: their tiers), or both")
def check(file: str, no_env: bool, role: str) -> None:
    """Check FILE (and the KVPORT_* variables over it): every problem with its line and key, exit 2."""
    env = environ()
    if no_env:
        overrides = {env_name(k) for k in KEYS}
        env = {k: v for k, v in env.items() if k not in overrides}
    try:
        kv = load_config(file, env, role)
    except ConfigFileError as exc:
        for p in exc.problems:
            click.echo(str(p), err=True)
        n = len(exc.problems)
        click.echo(f"kvport config check: {n} problem{'s' if n != 1 else ''} in {file}", err=True)
        raise SystemExit(2) from None
    for w in kv.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(f"OK: {file}")
    for line in summary(kv):
        click.echo(f"  {line}")


def summary(kv: KVPortConfig) -> list[str]:
    """What the config sets up, one line per part (the entry points' defaults where the file is silent)."""
    s, t, lim = kv.server, kv.tiers, kv.limits
    disk_size = "4 x capacity" if s.disk_capacity_bytes is None else format_bytes(s.disk_capacity_bytes)
    disk = "no disk" if s.disk_dir is None else f"disk {s.disk_dir} ({disk_size})"
    auth = "a token" if s.auth_token else "no token"
    tenants = "one default tenant" if kv.tenants is None else ", ".join(
        e.name + (f" (quota {format_bytes(e.quota_bytes)})" if e.quota_bytes else "") + (" admin" if e.admin else "")
        for e in kv.tenants)
    remote = [f"kvport serve {join_address(t.remote.server)}" if t.remote.server else "",
              f"redis {redact_url(t.remote.redis)}" if t.remote.redis else ""]
    return [
        f"server     listen {join_address(s.listen)}, capacity {format_bytes(s.capacity_bytes)}, {disk}, "
        f"page {format_bytes(s.page_bytes)}, TLS {'on' if s.tls else 'off'}, {auth}",
        f"tiers      host {format_bytes(t.host.capacity_bytes)} ({t.host.codec}); disk "
        f"{t.disk.path or '-'} {format_bytes(t.disk.capacity_bytes)} ({t.disk.codec}); remote "
        f"{' + '.join(r for r in remote if r) or '-'} (tenant {t.remote.tenant}, write {t.remote.write}); "
        f"hand-off links {kv.links.handoff_codec}",
        f"eviction   {kv.eviction or 'each entry point its default'}; lifetimes: request "
        f"{kv.lifetimes.request_ttl_s:g} s, session {kv.lifetimes.session_ttl_s:g} s; load deadline "
        f"{kv.load_deadline.min_s:g}:{kv.load_deadline.factor:g}:{kv.load_deadline.max_s:g}",
        f"limits     max value {format_bytes(lim.max_value_bytes)}, in flight {format_bytes(lim.inflight_bytes)}, "
        f"{lim.max_connections} connections ({lim.max_pending} logging in, {lim.max_per_peer or 'any'} per peer)",
        f"tenants    {tenants}",
        f"keys set   {len(kv.given)} (the rest: defaults)",
    ]
