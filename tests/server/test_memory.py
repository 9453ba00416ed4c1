"""A server's resident memory follows what it holds (``kvport serve --capacity`` is a ceiling, not an
allocation), unless it is asked to fault its pool in at start."""

from __future__ import annotations

import os
from typing import Any

import psutil

MiB = 1 << 20


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def test_an_idle_server_holds_its_baseline_not_its_capacity_and_grows_as_it_fills(server_factory: Any) -> None:
    srv = server_factory("--listen", "127.0.0.1:0", "--capacity", "2GiB", "--max-value", "32MiB",
                         "--inflight", "64MiB")
    idle = _rss(srv.pid)
    assert idle < 600 * MiB, idle  # interpreter + libraries + the first 64 MiB step, not 2 GiB
    value = os.urandom(MiB) * 16
    with srv.client() as c:
        for i in range(12):  # 192 MiB of values
            c.put(i.to_bytes(16, "little"), value)
        assert all(c.get(i.to_bytes(16, "little")) == value for i in range(12))
    grown = _rss(srv.pid)
    assert grown - idle > 150 * MiB, (idle, grown)  # the pages were faulted in as the values arrived
    assert grown < 2048 * MiB


def test_prefault_makes_the_pool_resident_at_start(server_factory: Any) -> None:
    srv = server_factory("--listen", "127.0.0.1:0", "--capacity", "1GiB", "--max-value", "32MiB",
                         "--inflight", "64MiB", "--prefault")
    assert srv.info["prefault"] is True
    assert _rss(srv.pid) > srv.info["host_capacity"]  # the whole pool, before any put
