"""Emulated links (kvport.evidence.netlink): two real network namespaces, a veth pair shaped with tc,
and a KV peer process on the far side moving exact bytes across it."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from kvport.errors import ConfigError
from kvport.evidence.netlink import LINKS, ShapedLink, in_netns, unavailable
from kvport.planner.throttle import LoopbackPeer

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout


def test_a_peer_across_a_shaped_link_moves_exact_bytes_and_the_namespaces_go_after() -> None:
    link = ShapedLink("1g-1ms")
    with link:
        for side in (0, 1):
            shown = link.qdisc(side)
            assert "1Gbit" in shown and ("netem" in shown) == link.delay_emulated
        assert link.describe()["delay_emulated"] == link.delay_emulated
        rng = np.random.default_rng(3)
        data = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
        with LoopbackPeer(data.nbytes, link=link) as peer:
            peer.put(0, data.data)
            out = np.empty_like(data)
            peer.get_into(0, out.data.cast("B"))
            assert np.array_equal(out, data)
            peer.get_into(1 << 20, out[: 1 << 20].data.cast("B"), rate=50e6)  # throttled below the link's rate
            assert np.array_equal(out[: 1 << 20], data[1 << 20 : 2 << 20])
            # the peer really is the other host: its own namespace, reached at the far address
            assert os.readlink(f"/proc/{peer._proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")
            assert peer._t.sock.getpeername()[0] == link.addr[1]
        if not link.delay_emulated:  # this kernel shapes the rate only: loss is refused, typed
            with pytest.raises(ConfigError, match="netem"):
                link.set_loss(1.0)
    assert link.ns[0] not in _namespaces() and link.ns[1] not in _namespaces()


def test_unknown_links_and_namespaces_are_config_errors() -> None:
    assert {"10g-50us", "1g-1ms"} <= set(LINKS)
    with pytest.raises(ConfigError, match="unknown link"):
        ShapedLink("100g-1ns")
    with pytest.raises(ConfigError, match="no network namespace"), in_netns("kvp-none-such"):
        pass
