"""RemoteTier keeps the Tier contract against a real server."""

from __future__ import annotations

import numpy as np
import pytest

from kvport.client.remote import Stored
from kvport.errors import BlockNotFoundError, BufferMismatchError
from kvport.tiers.base import Tier

from .conftest import MiB


def test_remote_tier_honours_the_tier_contract(shared_server) -> None:  # type: ignore[no-untyped-def]
    t = shared_server.client()
    assert isinstance(t, Tier) and t.caps.shared and t.caps.max_value_bytes == 32 * MiB
    k1, k2, missing = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    v1 = np.arange(MiB + 3, dtype=np.uint8)
    used0 = t.used_bytes
    t.put(k1, v1)
    assert t.put_value(k1, v1) == Stored(existed=True)  # idempotent by key: a retried put is a no-op
    t.put(k2, b"small value")
    assert t.size_of(k1) == v1.nbytes and t.size_of(missing) is None
    assert t.contains_many([k1, missing, k2]) == [True, False, True]
    assert {k1, k2} <= set(t.keys())
    assert t.get(k2) == b"small value"
    assert t.used_bytes - used0 == 3 * MiB  # charged in whole 1 MiB pages
    assert t.capacity_bytes >= shared_server.info["host_capacity"]
    with pytest.raises(BlockNotFoundError):
        t.get_into(missing, bytearray(16))
    with pytest.raises(BufferMismatchError):
        t.get_into(k1, bytearray(MiB))  # too small: refused, nothing written past the buffer
    assert t.get_many_into([(k1, bytearray(2 * MiB)), (missing, bytearray(1))]) == [v1.nbytes, None]
    with pytest.raises(BufferMismatchError):
        t.put(b"\x04" * 16, b"")
    assert t.delete(k1) and not t.delete(k1)
    assert t.delete_many([k2, missing]) == 1
    assert t.used_bytes == used0
    t.close()


@pytest.mark.parametrize("io_threads", ["0", "4"])
def test_values_round_trip_with_and_without_bulk_io_threads(server_factory, io_threads) -> None:  # type: ignore[no-untyped-def]
    """Large payloads go through the bulk I/O threads (or the event loop with 0); many clients at
    once, values of several sizes around the offload threshold, every byte compared."""
    import threading

    from .conftest import base_args

    srv = server_factory(*base_args("256MiB", "--io-threads", io_threads))
    rng = np.random.default_rng(11)
    values = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1000, 256 * 1024 - 1, 256 * 1024, 3 * MiB + 5,
                                                                  9 * MiB)]
    errors: list[str] = []

    def client(c: int) -> None:
        t = srv.client()
        out = bytearray(9 * MiB)
        for round_ in range(3):
            for i, v in enumerate(values):
                key = bytes([c, round_, i]) + b"\x00" * 13
                t.put(key, v)
                n = t.get_into(key, out)
                if n != v.nbytes or out[:n] != v.tobytes():
                    errors.append(f"client {c} value {i} round {round_}")
                t.delete(key)
        t.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_get_into_reports_verified_ranges_in_order(shared_server) -> None:  # type: ignore[no-untyped-def]
    t = shared_server.client()
    key = b"\x09" * 16
    value = np.random.default_rng(5).integers(0, 256, 5 * MiB + 123, dtype=np.uint8)
    t.put(key, value)
    out = bytearray(6 * MiB)
    ranges: list[tuple[int, int]] = []
    seen: list[bytes] = []

    def on_verified(off: int, n: int) -> None:
        ranges.append((off, n))
        seen.append(bytes(out[off : off + n]))  # already landed and verified when reported

    assert t.get_into(key, out, on_verified=on_verified) == value.nbytes
    assert ranges[0][0] == 0 and sum(n for _, n in ranges) == value.nbytes
    assert all(ranges[i][0] + ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    assert len(ranges) == 6  # one per 1 MiB page (the server's chunk), the last one short
    assert b"".join(seen) == value.tobytes()
    t.delete(key)
    t.close()


def test_the_store_port_hands_out_the_servers_tier_typed(shared_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvport.client.conn import ClientConfig
    from kvport.client.port import SERVER_TIER, StoreConfig, open_port
    from kvport.client.remote import RemoteTier
    from kvport.errors import ConfigError
    from kvport.store import WriteMode

    server = ClientConfig(port=shared_server.port)
    opened = open_port(StoreConfig(block_bytes=MiB, host_bytes=4 * MiB, server=server, server_write=WriteMode.BEHIND))
    try:
        assert isinstance(opened.server, RemoteTier) and opened.server.name == SERVER_TIER
        assert opened.store.tiers[SERVER_TIER] is opened.server
    finally:
        opened.store.close()
        for tier in opened.store.tiers.values():
            tier.close()
    alone = open_port(StoreConfig(block_bytes=MiB, host_bytes=4 * MiB))
    assert alone.server is None
    alone.store.close()
    with pytest.raises(ConfigError, match="server_write needs a server"):
        StoreConfig(block_bytes=MiB, host_bytes=4 * MiB, server_write=WriteMode.THROUGH)
    with pytest.raises(ConfigError, match="server_write"):
        StoreConfig(block_bytes=MiB, server=server, server_write=WriteMode.THROUGH, write_through=(SERVER_TIER,))
