"""The store port: every engine (transformers, vLLM, the demo's workers) reaches storage through one
:class:`~kvport.store.TieredStore`, built here from one typed :class:`StoreConfig`.

::

    StoreConfig(host_bytes, block_bytes)           --> HostTier            (hot, zero-copy reads)
              + disk_dir, disk_bytes, disk_shared  --> DiskTier            (persistent; shared: several
                                                                            engine processes, each sees
                                                                            the others' saves)
              + redis_url                          --> RedisTier           (a shared tier beyond one machine:
                                                                            one server, or ?cluster=true)
              + server=ClientConfig(...)           --> RemoteTier          (the kvport server: the pool)
                + server_write=THROUGH | BEHIND                            (every put copied to it)
    open_store(cfg, ledger) -> TieredStore(tiers top-down, ledger, eviction policy)
    open_port(cfg, ledger)  -> OpenedStore(store, server: the RemoteTier or None,
                                           book: the Redis tier's pool records or None)

The store decides placement, eviction (prefix-aware), promotion and lifetimes; its ledger records
what the pool owns. What an engine needs from it: ``lookup`` (longest cached prefix),
``get_many_into`` / ``consume`` (loads), ``put_many`` (a chain of blocks under its parent), and
:meth:`~kvport.store.TieredStore.contains`; and, through :func:`open_port`, the server's tier itself
(leases and pins are the pool's, not the store's), typed, never looked up by its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvport.client.conn import ClientConfig
from kvport.client.redis_pool import PoolBook
from kvport.client.remote import RemoteTier
from kvport.errors import ConfigError
from kvport.ledger import Ledger
from kvport.store import TieredStore, TierPolicy, WriteMode
from kvport.store.eviction import DEFAULT_POLICY
from kvport.tiers.base import Tier

SERVER_TIER = "shared"  # the kvport server's tier, in the store's names (tier labels of its metrics)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    block_bytes: int  # one block's bytes (the host tier's page)
    host_bytes: int = 0  # 0: no host tier
    disk_dir: Path | None = None
    disk_bytes: int = 0
    disk_shared: bool = False  # other processes write the folder while this one runs
    disk_refresh_s: float | None = 1.0  # a miss rescans the shared folder at most this often (one stat if unchanged)
    redis_url: str | None = None
    server: ClientConfig | None = None  # the kvport server (shared tier) at the bottom
    eviction: str = DEFAULT_POLICY
    write_through: tuple[str, ...] = ()  # tiers written on every put (e.g. "shared"); others get demotions
    write_behind: tuple[str, ...] = ()  # tiers written after every put, by the store's writer thread
    server_write: WriteMode | None = None  # how the server's tier gets every put (None: demotions only)

    def __post_init__(self) -> None:
        if self.block_bytes <= 0:
            raise ConfigError(f"block_bytes must be positive, got {self.block_bytes}")
        if self.host_bytes and self.host_bytes < self.block_bytes:
            raise ConfigError(f"host_bytes {self.host_bytes} holds no block of {self.block_bytes}")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ConfigError("a disk tier needs disk_bytes > 0")
        both = set(self.write_through) & set(self.write_behind)
        if both:
            raise ConfigError(f"tiers {sorted(both)} are both write_through and write_behind")
        if self.server_write is not None and self.server is None:
            raise ConfigError("server_write needs a server")
        if self.server_write is not None and SERVER_TIER in {*self.write_through, *self.write_behind}:
            raise ConfigError("the server's tier is given server_write and in write_through / write_behind")


@dataclass(frozen=True, slots=True)
class OpenedStore:
    """A store opened by the port, with the tier an engine talks to beside the store: the kvport
    server's (``lease``/``pin`` of handed-off blocks), None when the store has no server."""

    store: TieredStore
    server: RemoteTier | None
    book: PoolBook | None = None  # the Redis tier's pool records (leases, pins: kvport.client.redis_pool)

    @property
    def pool(self) -> RemoteTier | PoolBook | None:
        """Where hand-offs are leased: the server's tier, else the Redis tier's book (None: neither)."""
        return self.server if self.server is not None else self.book


def open_store(cfg: StoreConfig, ledger: Ledger | None = None) -> TieredStore:
    """The store an engine uses; tiers top-down: host, disk, redis, server (whichever are configured)."""
    return open_port(cfg, ledger).store


def open_port(cfg: StoreConfig, ledger: Ledger | None = None) -> OpenedStore:
    """:func:`open_store`, and the server's tier it holds (None without ``cfg.server``)."""
    tiers: list[Tier] = []
    server: RemoteTier | None = None
    book: PoolBook | None = None
    try:
        if cfg.host_bytes:
            from kvport.tiers.host import HostTier

            tiers.append(HostTier(cfg.host_bytes, cfg.block_bytes, name="host"))
        if cfg.disk_dir is not None:
            from kvport.tiers.disk import DiskTier

            tiers.append(DiskTier(cfg.disk_dir, cfg.disk_bytes, name="disk", shared=cfg.disk_shared,
                                  refresh_s=cfg.disk_refresh_s))
        if cfg.redis_url is not None:
            from kvport.tiers.redis_tier import RedisTier

            redis_tier = RedisTier.from_url(cfg.redis_url, name="redis")
            tiers.append(redis_tier)
            book = PoolBook(redis_tier) if redis_tier.keeps_records else None
        if cfg.server is not None:
            server = RemoteTier(cfg.server, name=SERVER_TIER)
            tiers.append(server)
        if not tiers:
            raise ConfigError("a store needs at least one tier (host, disk, redis or server)")
        policies = {n: TierPolicy(write=WriteMode.THROUGH) for n in cfg.write_through}
        policies.update({n: TierPolicy(write=WriteMode.BEHIND) for n in cfg.write_behind})
        if cfg.server_write is not None:
            policies[SERVER_TIER] = TierPolicy(write=cfg.server_write)
        unknown = set(policies) - {t.name for t in tiers}
        if unknown:
            raise ConfigError(f"write_through / write_behind name tiers this store does not have: {sorted(unknown)}")
        return OpenedStore(TieredStore(tiers, ledger, eviction=cfg.eviction, tier_policies=policies), server, book)
    except BaseException:
        for t in tiers:
            t.close()
        raise
