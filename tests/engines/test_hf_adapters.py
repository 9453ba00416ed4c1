"""StoreBlocks.read_each: blocks adjacent in the host pool come as one run, others one by one, a
disk-held block through the scratch copy, and a block of the wrong size never reaches the caller."""

from pathlib import Path

import numpy as np
import pytest
import torch

from kvport.engines.hf import StoreBlocks
from kvport.errors import BufferMismatchError
from kvport.spec import DType, KVSpec
from kvport.store import Lifetime, TieredStore, TierPolicy
from kvport.tiers import DiskTier, HostTier


def _spec() -> KVSpec:
    return KVSpec(model_id="tiny", num_layers=2, num_kv_heads=1, head_dim=4, dtype=DType.FP32, block_size=2)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_adjacent_host_pages_come_as_one_run_and_disk_blocks_one_by_one(tmp_path: Path) -> None:
    spec = _spec()
    bb = spec.bytes_per_block
    exact = TierPolicy(high_watermark=1.0, low_watermark=1.0)
    store = TieredStore([HostTier(4 * bb, bb, name="host"), DiskTier(tmp_path, 1 << 20, name="disk")],
                        tier_policies={"host": exact})
    blocks = torch.arange(6 * bb // 4, dtype=torch.float32).view(6, -1)
    sb = StoreBlocks(store, spec)
    sb.write([_key(i) for i in range(6)], blocks, Lifetime.SESSION)  # 4 fit the host, 2 go down to disk
    where = store.lookup([_key(i) for i in range(6)]).tiers
    got: list[tuple[int, bytes]] = []
    sb.read_each([_key(i) for i in range(6)], lambda i, v: got.append((i, bytes(v))))
    # every byte arrives once, in key order, and each call covers whole blocks
    assert b"".join(b for _, b in got) == blocks.numpy().tobytes()
    assert all(len(b) % bb == 0 for _, b in got)
    starts = [i for i, _ in got]
    assert starts == sorted(starts) and starts[0] == 0
    host_calls = [(i, len(b) // bb) for i, b in got if where[i] == "host"]
    assert len(host_calls) < where.count("host")  # host blocks were joined into runs
    assert sum(n for i, n in [(i, len(b) // bb) for i, b in got if where[i] == "disk"]) == where.count("disk")


def test_a_block_of_the_wrong_size_is_refused_before_the_caller_sees_it() -> None:
    spec = _spec()
    bb = spec.bytes_per_block
    store = TieredStore([HostTier(4 * bb, bb)])
    store.put(_key(0), np.zeros(bb, dtype=np.uint8))
    store.put(_key(1), np.zeros(bb // 2, dtype=np.uint8), parent=_key(0))
    seen: list[int] = []
    with pytest.raises(BufferMismatchError):
        StoreBlocks(store, spec).read_each([_key(0), _key(1)], lambda i, v: seen.append(i))
    assert 1 not in seen
