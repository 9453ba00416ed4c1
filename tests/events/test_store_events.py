"""A store's tier changes as KV events (kvport.events.store): every block in and out of every tier,
named by tier, medium and locality; and end to end over real ZeroMQ into a PrefixIndex that then
answers which prefix the store holds where."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvport.events.store import StoreEvents
from kvport.events.wire import BlockRemoved, BlockStored, Event
from kvport.route.index import Place, PrefixIndex
from kvport.store import TieredStore, TierPolicy
from kvport.tiers.disk import DiskTier
from kvport.tiers.host import HostTier

EXACT = TierPolicy(high_watermark=1.0, low_watermark=1.0)


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chain(store: TieredStore, ids: range) -> None:
    parent = None
    for i in ids:
        store.put(k(i), bytes([i]) * 32, parent=parent)
        parent = k(i)


def collected(tmp_path: Path, host_blocks: int) -> tuple[TieredStore, StoreEvents, list[Event]]:
    got: list[Event] = []
    host = HostTier(host_blocks * 64, 64, name="host")
    disk = DiskTier(tmp_path, 1 << 20, name="disk")
    ev = StoreEvents([host, disk], lambda batch: got.extend(batch), block_size=16, flush_s=3600)
    return TieredStore([host, disk], tier_policies={"host": EXACT}, changes=ev), ev, got


def test_every_block_in_and_out_of_every_tier_is_an_event(tmp_path: Path) -> None:
    store, ev, got = collected(tmp_path, host_blocks=2)
    try:
        chain(store, range(3))  # two in host, the third on disk (host was full)
        assert store.evict("host", 32) > 0  # a leaf of host demoted to disk
        ev.flush()
        stored = [(e.ownership, e.block_hashes) for e in got if isinstance(e, BlockStored)]
        removed = [(e.ownership, e.block_hashes) for e in got if isinstance(e, BlockRemoved)]
        held = {}
        for e in got:  # replaying the events gives exactly what each tier's index holds
            for h in e.block_hashes:  # type: ignore[union-attr]
                held.setdefault(e.ownership, set())  # type: ignore[union-attr]
                (held[e.ownership].add if isinstance(e, BlockStored) else held[e.ownership].discard)(h)  # type: ignore[union-attr]
        assert held["kvport:host"] == {key for key in map(k, range(3)) if store.lookup([key]).tiers == ("host",)}
        assert removed and removed[0][0] == "kvport:host" and stored[-1][0] == "kvport:disk"  # the demotion
        assert all(e.medium == "CPU" and e.locality == "LOCAL" for e in got if e.ownership == "kvport:host")  # type: ignore[union-attr]
        assert all(e.medium == "STORAGE" for e in got if e.ownership == "kvport:disk")  # type: ignore[union-attr]
        got.clear()
        assert store.delete(k(0))  # the block and its cached descendants, from every tier
        ev.flush()
        gone = {h for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert gone == {k(0), k(1), k(2)} and not any(isinstance(e, BlockStored) for e in got)
    finally:
        ev.close()


def test_a_chain_stored_in_one_tier_is_one_event_with_its_parent(tmp_path: Path) -> None:
    store, ev, got = collected(tmp_path, host_blocks=8)
    try:
        store.put(k(9), b"x" * 32)
        chain(store, range(4))
        ev.flush()
        assert [(e.block_hashes, e.parent_block_hash) for e in got if isinstance(e, BlockStored)] == \
            [((k(9), ), None), ((k(0), k(1), k(2), k(3)), None)]
    finally:
        ev.close()


def test_a_store_s_events_reach_a_prefix_index_over_zeromq(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    from kvport.events.bus import EventPublisher, Subscription

    with EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
        sub = Subscription(pub.endpoint, pub.replay_endpoint)
        host = HostTier(8 * 64, 64, name="host")
        ev = StoreEvents([host], pub.publish, block_size=16, flush_s=0.01)
        store = TieredStore([host], changes=ev)
        ix = PrefixIndex()
        try:
            end = time.monotonic() + 10
            i = 100
            while not sub.poll(0.05) and time.monotonic() < end:  # PUB drops what precedes the subscription
                store.put(k(i), b"p" * 32)
                i += 1
            chain(store, range(5))
            end = time.monotonic() + 10
            while ix.match("engine-a", [k(j) for j in range(5)]).blocks < 5 and time.monotonic() < end:
                for d in sub.poll(0.05):
                    ix.apply("engine-a", d.batch, d.seq)
            m = ix.match("engine-a", [k(j) for j in range(6)])
            assert m.blocks == 5 and set(m.places) == {Place.HOST}
        finally:
            ev.close()
            sub.close()
