"""The store port: every engine (transformers, vLLM, the demo's workers) reaches storage through one
:class:`~kvport.store.TieredStore`, built here from one typed :class:`StoreConfig`.

::

    StoreConfig(host_bytes, block_bytes)           --> HostTier            (hot, zero-copy reads)
              + disk_dir, disk_bytes, disk_shared  --> DiskTier            (persistent; shared: several
                                                                            engine processes, each sees
                                                                            the others' saves)
              + redis_url                          --> RedisTier           (a shared tier beyond one machine)
              + server=ClientConfig(...)           --> RemoteTier          (the kvport server: the pool)
    open_store(cfg, ledger) -> TieredStore(tiers top-down, ledger, eviction policy)

The store decides placement, eviction (prefix-aware), promotion and lifetimes; its ledger records
what the pool owns. What an engine needs from it: ``lookup`` (longest cached prefix),
``get_many_into`` / ``consume`` (loads), ``put_many`` (a chain of blocks under its parent), and
:meth:`~kvport.store.TieredStore.contains`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvport.client.conn import ClientConfig
from kvport.client.remote import RemoteTier
from kvport.errors import ConfigError
from kvport.ledger import Ledger
from kvport.store import TieredStore, TierPolicy, WriteMode
from kvport.tiers.base import Tier


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
    eviction: str = "slru"
    write_through: tuple[str, ...] = ()  # tiers written on every put (e.g. "shared"); others get demotions
    write_behind: tuple[str, ...] = ()  # tiers written after every put, by the store's writer thread

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


def open_store(cfg: StoreConfig, ledger: Ledger | None = None) -> TieredStore:
    """The store an engine uses; tiers top-down: host, disk, redis, server (whichever are configured)."""
    tiers: list[Tier] = []
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

            tiers.append(RedisTier(cfg.redis_url, name="redis"))
        if cfg.server is not None:
            tiers.append(RemoteTier(cfg.server, name="shared"))
        if not tiers:
            raise ConfigError("a store needs at least one tier (host, disk, redis or server)")
        policies = {n: TierPolicy(write=WriteMode.THROUGH) for n in cfg.write_through}
        policies.update({n: TierPolicy(write=WriteMode.BEHIND) for n in cfg.write_behind})
        unknown = set(policies) - {t.name for t in tiers}
        if unknown:
            raise ConfigError(f"write_through / write_behind name tiers this store does not have: {sorted(unknown)}")
        return TieredStore(tiers, ledger, eviction=cfg.eviction, tier_policies=policies)
    except BaseException:
        for t in tiers:
            t.close()
        raise
