"""RemoteTier keeps the Tier contract against a real server."""

from __future__ import annotations

import numpy as np
import pytest

from kvport.errors import BlockNotFoundError, BufferMismatchError
from kvport.server.client import Stored
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
