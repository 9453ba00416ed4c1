"""What STATS reports, against a server run in this process (its state is inspected)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import psutil

from kvport.client import ClientConfig, RemoteTier
from kvport.server.app import KVServer, ServerConfig
from kvport.server.limits import ServerLimits

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB


def test_hit_counts_stay_bounded_while_read_blocks_are_evicted(tmp_path: Path) -> None:
    """Every block is read once and then evicted by the blocks put after it, and nobody asks for
    STATS: the hit counts stay within 2 x blocks stored + 64, and the top prefixes stay exact."""
    limits = ServerLimits(max_value_bytes=PAGE, total_inflight_bytes=MiB, max_held_per_client=1024,
                          max_held_per_tenant=1024)
    rss = int(psutil.Process().memory_info().rss)  # the host pool is what the capacity leaves above this
    cfg = ServerConfig(capacity_bytes=rss + 24 * MiB, page_bytes=PAGE, limits=limits, io_threads=0)
    value = np.full(4 * KiB, 7, dtype=np.uint8)

    async def scenario() -> None:
        srv = KVServer(cfg)
        await srv.start()
        try:
            pages = srv.state.store.tiers["host"].capacity_bytes // PAGE
            n = 3 * pages + 200  # two thirds of them evicted by the time the last is put

            def work() -> tuple[int, int, list[tuple[str, int]]]:
                c = RemoteTier(ClientConfig(port=srv.port, pool_size=1))
                try:
                    buf = bytearray(4 * KiB)
                    for i in range(n):
                        key = i.to_bytes(16, "big")
                        c.put(key, value)
                        c.get_into(key, buf)
                    c.ping()  # answered once the last GET's handler finished (one request at a time)
                    held = len(srv.state.hits)
                    stored = len(srv.state.store)
                    last = (n - 1).to_bytes(16, "big")
                    for _ in range(4):
                        c.get_into(last, buf)
                    top = [(p.key, p.hits) for p in c.stats().top_prefixes]
                    return held, stored, top
                finally:
                    c.close()

            held, stored, top = await asyncio.to_thread(work)
            assert n > 2 * stored + 64  # the loop read more blocks than the bound: it means something
            assert held <= 2 * stored + 64, (held, stored, n)
            assert top[0] == ((n - 1).to_bytes(16, "big").hex(), 5)
            assert all(h == 1 for _, h in top[1:])
        finally:
            await srv.shutdown()

    asyncio.run(scenario())
