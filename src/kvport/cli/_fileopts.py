"""``--config FILE`` for a command: the file's keys become the defaults of the command's flags.

The option is eager: it is read before every other option, and what the file (or a ``KVPORT_*``
variable, :func:`kvport.configfile.load_config`) sets goes into click's ``default_map``. So a flag
typed on the command line wins (``ParameterSource.COMMANDLINE``), then the file
(``ParameterSource.DEFAULT_MAP``), then the flag's own default, and each value still passes the
flag's type and callback. What has no flag (tenants, the auth token, lifetimes) is read by the
command from :func:`file_config`::

    @click.command()
    @config_option(serve_defaults)
    @click.option("--capacity", default="8GiB", callback=as_size)
    def serve_cmd(capacity: int) -> None:
        kv = file_config()   # the KVPortConfig (defaults and KVPORT_* variables without --config)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from kvport.configfile import KVPortConfig, join_address, load_config

_META = "kvport.configfile"
F = TypeVar("F", bound=Callable[..., Any])


def config_option(defaults: Callable[[KVPortConfig], dict[str, Any]], role: str) -> Callable[[F], F]:
    """The eager ``--config FILE`` option; ``defaults`` maps a config to ``{parameter name: value}``;
    ``role``: who reads it (:data:`kvport.configfile.ROLES`)."""

    def load(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        if ctx.resilient_parsing:
            return
        kv = load_config(value, role=role)  # ConfigFileError (exit 2) lists every problem
        for w in kv.warnings:
            click.echo(f"kvport: warning: {w}", err=True)
        ctx.meta[_META] = kv
        ctx.default_map = {**(ctx.default_map or {}), **defaults(kv)}

    return click.option("--config", "config_file", default=None, metavar="FILE", is_eager=True, expose_value=False,
                        type=click.Path(dir_okay=False, exists=True), callback=load,
                        help="a kvport config file (TOML, docs/kvport.example.toml): flags given here override it, "
                             "KVPORT_* variables override it too")


def file_config() -> KVPortConfig:
    """The config :func:`config_option` read for the running command."""
    kv = click.get_current_context().meta.get(_META)
    if not isinstance(kv, KVPortConfig):
        raise RuntimeError("file_config() outside a command with config_option")
    return kv


def serve_defaults(kv: KVPortConfig) -> dict[str, Any]:
    """``kvport serve``'s flags a config file sets: ``{parameter name: value}``."""
    s, lim = kv.server, kv.limits
    table: dict[str, tuple[str, Any]] = {
        "server.listen": ("listen", join_address(s.listen)),
        "server.http_port": ("http_port", s.http_port),
        "server.capacity": ("capacity", s.capacity_bytes),
        "server.disk": ("disk_dir", str(s.disk_dir)),
        "server.disk_capacity": ("disk_capacity", s.disk_capacity_bytes),
        "server.page_size": ("page_size", s.page_bytes),
        "server.io_threads": ("io_threads", s.io_threads),
        "server.spill_on_shutdown": ("no_spill", not s.spill_on_shutdown),
        "server.prefault": ("prefault", s.prefault),
        "server.tls.cert": ("tls_cert", None if s.tls is None else str(s.tls.cert)),
        "server.tls.key": ("tls_key", None if s.tls is None else str(s.tls.key)),
        "limits.max_value": ("max_value", lim.max_value_bytes),
        "limits.inflight": ("inflight", lim.inflight_bytes),
        "limits.idle_timeout_s": ("idle_timeout", lim.idle_timeout_s),
        "limits.frame_timeout_s": ("frame_timeout", lim.frame_timeout_s),
        "limits.write_timeout_s": ("write_timeout", lim.write_timeout_s),
        "limits.handshake_timeout_s": ("handshake_timeout", lim.handshake_timeout_s),
        "limits.max_connections": ("max_connections", lim.max_connections),
        "limits.max_pending": ("max_pending", lim.max_pending),
        "limits.max_per_peer": ("max_per_peer", lim.max_per_peer),
        "limits.per_peer_exempt": ("per_peer_exempt", ",".join(lim.per_peer_exempt)),
        "eviction.policy": ("eviction", kv.eviction),
    }
    return {name: value for key, (name, value) in table.items() if kv.sets(key)}
