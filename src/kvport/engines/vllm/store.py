"""The store an engine's kvport adapter opens from its ``kvport_*`` keys (:class:`.config.ConnectorConfig`):
vLLM's connector and SGLang's HiCache backend (:mod:`kvport.engines.sglang`) open theirs here, alike,
and read blocks back through :func:`read_checked`, the one check before a block reaches an engine's
KV. No vLLM import."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvport.client.conn import ClientConfig
from kvport.client.port import OpenedStore, StoreConfig, open_port
from kvport.codec.envelope import BlockFormat, stored_bytes
from kvport.config import Settings
from kvport.deadline import Deadline
from kvport.errors import CodecError
from kvport.spec import KVSpec
from kvport.store import TieredStore, WriteMode

from .config import ConnectorConfig

log = logging.getLogger(__name__)


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
        redis_url=cfg.redis_url, eviction=cfg.eviction,
        # a decode engine looks for a hand-off milliseconds after the prefill engine wrote it: every miss
        # may rescan (one stat of the folder when nothing changed)
        disk_refresh_s=0.0,
        write_behind=redis_write if write is WriteMode.BEHIND else (),
        write_through=redis_write if write is WriteMode.THROUGH else (),
        server_write=write if server is not None and (lower or cfg.redis_url is not None) else None))


@dataclass(frozen=True, slots=True)
class CheckedRead:
    good: int  # leading blocks that arrived whole and passed their envelope
    refused: int  # 1 when the block after them failed its envelope (deleted), else 0
    seconds: float  # the read's wall time
    whole: bool  # every block arrived at its full size (the read speed is meaningful)


def read_checked(store: TieredStore, fmt: BlockFormat, keys: Sequence[bytes], values: Sequence[memoryview], *,
                 deadline: Deadline | None, engine: str) -> CheckedRead:
    """Read ``keys`` into ``values`` (whole stored values, envelope included) with one batched store
    call, then open each envelope: how many leading blocks an engine may use. A block of the wrong
    size, or one its envelope refuses (damage, another key's value, another spec), is deleted (no
    reader of this spec can use it) and ends the run there; a missing one ends it too. Store errors
    (``TierError``, ``DeadlineExceeded``) propagate: the caller turns them into misses."""
    want = fmt.value_bytes
    t0 = time.perf_counter()
    got = store.get_many_into(list(zip(keys, values, strict=True)), deadline=deadline)
    dt = time.perf_counter() - t0
    for j, n in enumerate(got):
        if n != want:
            why = "missing, corrupt or past the deadline" if n is None else f"{n} bytes, a stored block is {want}"
            log.warning("kvport: block %s %s; %s recomputes from there", keys[j].hex(), why, engine)
            if n is not None:  # a value no reader of this spec can use (an old block, a truncated one)
                store.delete(keys[j])
            return CheckedRead(j, 0, dt, False)
        try:
            fmt.open(values[j], keys[j])
        except CodecError as exc:
            log.warning("kvport: block %s refused (%s: %s); deleted, %s recomputes from there",
                        keys[j].hex(), type(exc).__name__, exc, engine)
            store.delete(keys[j])
            return CheckedRead(j, 1, dt, True)
    return CheckedRead(len(keys), 0, dt, True)
