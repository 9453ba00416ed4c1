"""The store an engine's kvport adapter opens from its ``kvport_*`` keys (:class:`.config.ConnectorConfig`):
vLLM's connector and SGLang's HiCache backend (:mod:`kvport.engines.sglang`) open theirs here, alike.
No vLLM import."""

from __future__ import annotations

from kvport.client.conn import ClientConfig
from kvport.client.port import OpenedStore, StoreConfig, open_port
from kvport.codec.envelope import stored_bytes
from kvport.config import Settings
from kvport.spec import KVSpec
from kvport.store import WriteMode

from .config import ConnectorConfig


def open_connector_store(cfg: ConnectorConfig, spec: KVSpec) -> OpenedStore:
    """The connector's store: host RAM, the shared disk folder, Redis and the kvport server, whichever
    are configured, top-down; every save is copied to the shared tiers (Redis, the server: what other
    engines see): by the store's write-behind thread after the save returned (``kvport_server_write``:
    "behind"), or before it returns ("through"). With it, the server's tier (None without a server)."""
    server = None
    if cfg.server is not None:
        server = ClientConfig(host=cfg.server[0], port=cfg.server[1], tenant=cfg.server_tenant,
                              token=Settings.from_env().auth_token, timeout_s=10.0)
    lower = cfg.host_capacity_bytes > 0 or cfg.disk_dir is not None
    write = WriteMode.BEHIND if cfg.server_write_behind else WriteMode.THROUGH
    # Redis is written like the server: on every save when a tier above it takes the save first
    redis_above = cfg.redis_url is not None and lower
    redis_write = ("redis",) if redis_above else ()
    return open_port(StoreConfig(
        block_bytes=stored_bytes(spec), host_bytes=cfg.host_capacity_bytes, disk_dir=cfg.disk_dir,
        disk_bytes=cfg.disk_capacity_bytes if cfg.disk_dir is not None else 0, disk_shared=True, server=server,
        redis_url=cfg.redis_url,
        # a decode engine looks for a hand-off milliseconds after the prefill engine wrote it: every miss
        # may rescan (one stat of the folder when nothing changed)
        disk_refresh_s=0.0,
        write_behind=redis_write if write is WriteMode.BEHIND else (),
        write_through=redis_write if write is WriteMode.THROUGH else (),
        server_write=write if server is not None and (lower or cfg.redis_url is not None) else None))
