"""The loopback KV peer: a real process, real TCP, exact bytes back, ranges checked."""

from __future__ import annotations

import numpy as np
import pytest

from kvport.errors import PlanInputError
from kvport.planner.throttle import LoopbackPeer, chunk_for


def test_peer_serves_exact_ranges_throttled_and_not() -> None:
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    out = np.zeros_like(data)
    with LoopbackPeer(data.nbytes) as peer:
        peer.put(0, data.data)
        assert peer.ping() > 0
        secs = peer.get_into(0, memoryview(out.data), 0.0)
        assert secs > 0 and np.array_equal(out, data)
        out[:] = 0
        view = memoryview(out.data)[1000 : 1000 + (1 << 20)]
        peer.get_into(1000, view, 200e6)  # through the token bucket
        assert np.array_equal(out[1000 : 1000 + (1 << 20)], data[1000 : 1000 + (1 << 20)])
        assert not out[:1000].any() and not out[1000 + (1 << 20) :].any()
        with pytest.raises(PlanInputError):
            peer.get_into(data.nbytes - 10, memoryview(out.data)[:11])
        with pytest.raises(PlanInputError):
            peer.get_into(0, memoryview(out.data)[:10], -1.0)
        peer.get_into(0, memoryview(out.data)[:10], 0.0)  # still usable after a refused request
        assert np.array_equal(out[:10], data[:10])


def test_chunks_follow_the_rate() -> None:
    assert chunk_for(1e6) == 64 << 10
    assert chunk_for(100e6) == 500_000
    assert chunk_for(10e9) == 4 << 20
    with pytest.raises(PlanInputError):
        LoopbackPeer(0)
