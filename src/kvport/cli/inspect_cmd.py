"""``kvport inspect --server HOST:PORT``: usage, owners and leaks of a running server.

::

    kvport inspect --server H:P                  usage, tenants, top prefixes, pins, leases
    kvport inspect --server H:P --owners KEY     who holds the block KEY (32 hex) and the prefix it ends:
                                                 owner, tiers, lifetime, pins (holder, reason, since),
                                                 leases, the client that handed it to the pool
    kvport inspect --server H:P --owners ab12    every block whose key starts with that hex
    kvport inspect --server H:P --leaks          pins and leases past their TTL, blocks without an
                                                 owner, ledger records without bytes, orphan children
                                                 (exit code 1 when any)
    kvport inspect --handoff ADDR                an engine's hand-off ledger (ADDR: its inbox, HOST:PORT or
                                                 shm:NAME, authenticated with KVPORT_PD_SECRET): the newest
                                                 ownership moves -- blocks acquired, from whom, when, the
                                                 transfer id, handed to the pool or forgotten since
    kvport inspect --handoff ADDR --owners ab12  only the moves of blocks whose key starts with that hex
    kvport inspect --redis URL [--owners X | --leaks]
                                                 the same answers for a Redis (Cluster) shared tier, from
                                                 the pool's records kept in it (kvport.client.redis_pool):
                                                 who handed each block over, its lifetime, parent, TTL,
                                                 pins and leases; blocks without a record, records
                                                 without a block, children without their parent

A tenant sees its own blocks only; an admin tenant sees all. ``--json`` prints the typed answer.
"""

from __future__ import annotations

import dataclasses
import json
import ssl
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kvport.cli.serve_cmd import parse_listen
from kvport.client.conn import ClientConfig
from kvport.client.redis_pool import PoolBook
from kvport.client.remote import RemoteTier
from kvport.config import Settings
from kvport.errors import UserInputError
from kvport.keys import KEY_BYTES
from kvport.protocol.server import LeaksAnswer, OwnersAnswer, PinRow, StatsAnswer
from kvport.protocol.transfer import MAX_RECORDS
from kvport.transfer.handoff import records as handoff_records
from kvport.transfer.links import parse_address
from kvport.units import format_bytes


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _pins(rows: tuple[PinRow, ...]) -> str:
    return "; ".join(f"{p.holder} x{p.count} ({p.reason or 'no reason'}) since {p.since_s:.0f}s ago, "
                     f"expires in {_s(p.expires_in_s)}s" for p in rows) or "-"


def _render_stats(s: StatsAnswer, con: Console) -> None:
    srv = s.server
    if srv is not None:
        con.print("   ".join(f"{t.name} {format_bytes(t.used)} / {format_bytes(t.capacity)} ({t.blocks} blocks)"
                             for t in srv.tiers)
                  + f"   connections {srv.connections}   staging {format_bytes(srv.staging_bytes)}"
                  + f"   uptime {srv.uptime_s:.0f} s" + ("   DRAINING" if srv.draining else ""))
    t = Table("tenant", "bytes", "blocks", "quota", "connections", title="tenants")
    for row in s.tenants:
        t.add_row(row.name, format_bytes(row.bytes), str(row.blocks),
                  "-" if row.quota is None else format_bytes(row.quota), str(row.connections))
    con.print(t)
    t = Table("tenant", "prefix (last block key)", "hits", "bytes", "tier", title="top prefixes")
    for p in s.top_prefixes:
        t.add_row(p.tenant, p.key, str(p.hits), format_bytes(p.bytes), p.tier)
    con.print(t)
    t = Table("key", "holder", "pins", "reason", "since (s)", "expires in (s)", title="pins")
    for pin in s.pins:
        t.add_row(pin.key, pin.holder, str(pin.count), pin.reason, f"{pin.since_s:.0f}", _s(pin.expires_in_s))
    con.print(t)
    t = Table("lease", "holder", "blocks", "expires in (s)", title="leases")
    for ls in s.leases:
        t.add_row(str(ls.lease), ls.holder, str(ls.blocks), _s(ls.expires_in_s))
    con.print(t)


def _render_owners(o: OwnersAnswer, con: Console) -> None:
    t = Table("key", "owner", "handed off by", "tiers", "lifetime", "expires in (s)", "parent", "children",
              "pins (holder, reason, since)", "leases", title="owners" + (" (truncated)" if o.truncated else ""))
    for b in o.blocks:
        t.add_row(b.key, f"{b.owner} ({b.state}, {b.since_s:.0f}s)", b.handed_off_by or "-", ",".join(b.tiers),
                  b.lifetime.value, _s(b.expires_in_s), b.parent or "(root)", str(b.children), _pins(b.pins),
                  "; ".join(f"#{ls.lease} {ls.holder} {_s(ls.expires_in_s)}s" for ls in b.leases) or "-")
    con.print(t)
    if not o.blocks:
        con.print("no such block (or not this tenant's)")


def _render_leaks(rep: LeaksAnswer, con: Console) -> None:
    if rep.clean:
        con.print("no leaks: every pin and lease is within its TTL, every block has an owner and its parent")
        return
    for title, rows in (("pins past their TTL", [f"{p.key} {p.holder} ({p.reason}) {_s(p.expires_in_s)}s"
                                                 for p in rep.expired_pins]),
                        ("leases past their TTL", [f"#{ls.lease} {ls.holder} {ls.blocks} blocks "
                                                   f"{_s(ls.expires_in_s)}s" for ls in rep.expired_leases]),
                        ("blocks without an owner", list(rep.without_owner)),
                        ("ledger records without bytes", list(rep.unstored_records)),
                        ("children kept without their parent", list(rep.orphan_children))):
        if rows:
            con.print(f"[bold]{title}[/bold] ({len(rows)})")
            for r in rows:
                con.print(f"  {r}")


def _owner_query(arg: str) -> tuple[tuple[bytes, ...], str]:
    text = arg.strip().lower()
    if not text or len(text) > 2 * KEY_BYTES or any(c not in "0123456789abcdef" for c in text):
        raise UserInputError(f"--owners expects a block key (32 hex digits) or a hex prefix of one, got {arg!r}")
    if len(text) == 2 * KEY_BYTES:
        return (bytes.fromhex(text),), ""
    return (), text


def _inspect_handoff(address: str, limit: int, owners: str | None, as_json: bool) -> None:
    if parse_address(address) is None:
        raise UserInputError(f"--handoff expects HOST:PORT, shm:NAME or nixl:HOST:PORT, got {address!r}")
    prefix = ""
    if owners is not None:
        keys, prefix = _owner_query(owners)
        prefix = prefix or keys[0].hex()
    secret = Settings.from_env().pd_secret
    if not secret:
        raise UserInputError("--handoff authenticates with the deployment's hand-off secret: set KVPORT_PD_SECRET")
    answer = handoff_records(address, secret.encode(), limit)
    rows = [r for r in answer.records if r.key.startswith(prefix)]
    if as_json:
        click.echo(json.dumps({"owner": answer.owner, "held": answer.held,
                               "records": [dataclasses.asdict(r) for r in rows]}, indent=2))
        return
    t = Table("key", "move", "from", "to", "transfer id", "ago (s)",
              title=f"hand-off ledger of {answer.owner or '(no ledger)'}: {answer.held} blocks held now")
    for r in rows:
        t.add_row(r.key, r.move, r.owner_from or "-", r.owner_to or "-", r.tid or "-", f"{r.age_s:.1f}")
    Console().print(t)


def _ask_redis(url: str, query: tuple[tuple[bytes, ...], str] | None, leaks: bool) -> OwnersAnswer | LeaksAnswer:
    """Owners (``query``) or leaks of a Redis shared tier, from its pool records."""
    from kvport.tiers.redis_tier import RedisTier

    if query is None and not leaks:
        raise UserInputError("--redis answers --owners KEY|PREFIX or --leaks (usage is Redis's own: INFO)")
    tier = RedisTier.from_url(url, name="redis")
    try:
        book = PoolBook(tier)
        return book.owners(*query) if query is not None else book.leaks()
    finally:
        tier.close()


def _check_ca(path: str) -> None:
    """A CA file that does not load is the flag's error (the client would raise ssl's own on connect)."""
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        raise UserInputError(f"--tls-ca {path}: not a PEM CA certificate ({exc})") from exc


@click.command(name="inspect")
@click.option("--server", "server", default=None, help="HOST:PORT of a running kvport server")
@click.option("--redis", "redis_url", default=None, metavar="URL",
              help="a Redis or Redis Cluster shared tier (redis://H:P/0, ?cluster=true): its pool records")
@click.option("--handoff", "handoff", default=None, metavar="ADDR",
              help="an engine's hand-off inbox (HOST:PORT, shm:NAME or nixl:HOST:PORT): its ledger's newest "
                   "ownership moves")
@click.option("--limit", default=MAX_RECORDS, show_default=True, type=click.IntRange(1, MAX_RECORDS),
              help="--handoff: how many moves")
@click.option("--tenant", default="default", show_default=True)
@click.option("--token", default=None, help="tenant token (default: KVPORT_AUTH_TOKEN)")
@click.option("--tls", is_flag=True, help="connect with TLS")
@click.option("--tls-ca", default=None, type=click.Path(dir_okay=False, exists=True))
@click.option("--owners", "owners", default=None, metavar="KEY|PREFIX",
              help="who holds a block (32 hex digits: it and the prefix it ends) or every block with that hex prefix")
@click.option("--leaks", "leaks", is_flag=True, help="pins/leases past their TTL, blocks without owner or parent")
@click.option("--json", "as_json", is_flag=True, help="print the answer as JSON")
def inspect_cmd(server: str | None, redis_url: str | None, handoff: str | None, limit: int, tenant: str,
                token: str | None, tls: bool, tls_ca: str | None, owners: str | None, leaks: bool,
                as_json: bool) -> None:
    """Show a running server's usage, tenants, top prefixes, pins and leases; or owners; or leaks.
    With --redis, owners or leaks of a Redis shared tier; with --handoff, an engine's hand-off ledger."""
    if sum(x is not None for x in (server, redis_url, handoff)) != 1:
        raise UserInputError("give one of --server HOST:PORT (a kvport server), --redis URL (a Redis shared tier) "
                             "or --handoff ADDR (an engine's inbox)")
    if handoff is not None:
        _inspect_handoff(handoff, limit, owners, as_json)
        return
    query = _owner_query(owners) if owners is not None else None
    answer: StatsAnswer | OwnersAnswer | LeaksAnswer
    if redis_url is not None:
        answer = _ask_redis(redis_url, query, leaks)
    else:
        assert server is not None
        host, port = parse_listen(server, "--server")
        if tls_ca is not None:
            _check_ca(tls_ca)
        cfg = ClientConfig(host=host, port=port, tenant=tenant, token=token or Settings.from_env().auth_token,
                           tls=tls, tls_ca=Path(tls_ca) if tls_ca else None, pool_size=1, retries=1)
        tier = RemoteTier(cfg, name="server")
        try:
            if query is not None:
                answer = tier.owners(*query)
            elif leaks:
                answer = tier.leaks()
            else:
                answer = tier.stats()
        finally:
            tier.close()
    con = Console()
    if as_json:
        click.echo(json.dumps(answer.to_meta(), indent=2, default=lambda b: b.hex() if isinstance(b, bytes) else b))
    elif isinstance(answer, OwnersAnswer):
        _render_owners(answer, con)
    elif isinstance(answer, LeaksAnswer):
        _render_leaks(answer, con)
    else:
        _render_stats(answer, con)
    if isinstance(answer, LeaksAnswer) and not answer.clean:
        sys.exit(1)
