"""StoreBlocks and TierBlocks keep sealed blocks: written straight into reserved host pages, checked
on every load, and a block of another rank or head range, missing a part, with a part swapped in
from another block, or without an envelope at all never reaches the caller."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvport.codec.envelope import BlockFormat, PartKind, parse, stored_bytes
from kvport.engines.hf import StoreBlocks, TierBlocks
from kvport.errors import BlockNotFoundError, CodecParamsError, CorruptBlockError, CorruptPayloadError, EngineError
from kvport.spec import DType, KVSpec
from kvport.store import Lifetime, TieredStore, TierPolicy, WriteMode
from kvport.tiers import DiskTier, HostTier
from tests.codec.conftest import reseal

EXACT = TierPolicy(high_watermark=1.0, low_watermark=1.0)


def _spec(**changes: object) -> KVSpec:
    spec = KVSpec(model_id="tiny", num_layers=2, num_kv_heads=1, head_dim=4, dtype=DType.FP32, block_size=2)
    return spec.with_(**changes)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _blocks(spec: KVSpec, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *spec.block_shape), generator=g)


def _sealed(fmt: BlockFormat, block: torch.Tensor, key: bytes) -> np.ndarray:
    value = np.zeros(fmt.value_bytes, np.uint8)
    np.copyto(np.frombuffer(fmt.payload(value), np.uint8), block.numpy().reshape(-1).view(np.uint8))
    fmt.seal(value, key)
    return value


def _host_store(spec: KVSpec, blocks: int = 8) -> TieredStore:
    vb = stored_bytes(spec)
    return TieredStore([HostTier(blocks * vb, vb, name="host")], tier_policies={"host": EXACT})


def test_blocks_are_written_into_reserved_pages_and_read_back_checked(tmp_path: Path) -> None:
    spec = _spec()
    vb = stored_bytes(spec)
    host = HostTier(4 * vb, vb, name="host")
    store = TieredStore([host, DiskTier(tmp_path, 1 << 20, name="disk")], tier_policies={"host": EXACT})
    puts: list[bytes] = []
    real_put = store.put
    store.put = lambda key, *a, **kw: (puts.append(key), real_put(key, *a, **kw))[1]  # type: ignore[method-assign]
    blocks = _blocks(spec, 6)
    sb = StoreBlocks(store, spec)
    keys = [_key(i) for i in range(6)]
    sb.write(keys[:4], blocks[:4], Lifetime.SESSION)
    assert puts == []  # every block went through reserve/commit: filled in its page, no put copy
    sb.write(keys[4:], blocks[4:], Lifetime.SESSION, parent=keys[3])  # the host is full: some go to disk
    assert set(puts) <= set(keys[4:])  # where no page could be reserved: a put of the sealed value
    where = store.lookup(keys)
    assert where.prefix_blocks == 6 and set(where.tiers) == {"host", "disk"} and set(where.sizes) == {vb}
    assert [store.parent_of(k) for k in keys] == [None, *keys[:-1]]
    pool = np.frombuffer(host._mv, np.uint8)
    lo, hi = int(pool.ctypes.data), int(pool.ctypes.data) + pool.nbytes
    got: list[tuple[int, bytes, bool]] = []

    def fn(i: int, v: memoryview) -> None:
        at = int(np.frombuffer(v, np.uint8).ctypes.data)
        got.append((i, bytes(v), lo <= at < hi))

    sb.read_each(keys, fn)
    assert [i for i, _, _ in got] == list(range(6))  # one call per block, in key order
    assert b"".join(b for _, b, _ in got) == blocks.numpy().tobytes()  # the payloads, exactly
    pooled = [in_pool for _, _, in_pool in got]
    first_disk = where.tiers.index("disk")
    assert pooled[:first_disk] == [True] * first_disk  # host blocks: views of the pool's own pages (zero-copy)
    assert not any(p for p, t in zip(pooled, where.tiers, strict=True) if t == "disk")  # disk: the scratch
    out = torch.empty_like(blocks)
    sb.read_into(keys, out)
    assert torch.equal(out, blocks)


def test_write_through_tiers_and_held_keys_take_a_put(tmp_path: Path) -> None:
    spec = _spec()
    vb = stored_bytes(spec)
    store = TieredStore([HostTier(8 * vb, vb, name="host"), DiskTier(tmp_path, 1 << 20, name="disk")],
                        tier_policies={"disk": TierPolicy(write=WriteMode.THROUGH)})
    blocks = _blocks(spec, 3)
    sb = StoreBlocks(store, spec)
    sb.write([_key(i) for i in range(3)], blocks, Lifetime.PREFIX)
    assert all(store.where(_key(i)) == ("host", "disk") for i in range(3))
    sb.write([_key(0)], blocks[:1], Lifetime.PREFIX)  # already held: touched, not rewritten
    out = torch.empty_like(blocks)
    sb.read_into([_key(i) for i in range(3)], out)
    assert torch.equal(out, blocks)


def _planted(spec: KVSpec, value: np.ndarray | bytes, key: bytes = _key(0)) -> tuple[TieredStore, StoreBlocks]:
    """A store holding ``value`` under ``key`` (the store never looks inside values)."""
    store = _host_store(spec)
    store.put(key, value)
    return store, StoreBlocks(store, spec)


def _refused(sb: StoreBlocks, key: bytes = _key(0)) -> None:
    seen: list[int] = []
    with pytest.raises((CorruptBlockError, BlockNotFoundError)):
        sb.read_each([key], lambda i, v: seen.append(i))
    assert seen == []  # fn never saw a byte of it
    assert key not in sb.store  # dropped: the next lookup is a clean miss
    assert sb.longest_prefix([key]) == 0


def test_a_block_of_another_rank_or_head_range_under_the_right_key_is_refused() -> None:
    spec = _spec(num_kv_heads=2, tp_size=2)  # rank 0 of 2: KV head [0, 1)
    block = _blocks(spec, 1)[0]
    rank1 = _sealed(BlockFormat(spec.with_(tp_rank=1)), block, _key(0))  # same size, same key, rank 1's heads
    _, sb = _planted(spec, rank1)
    assert sb.longest_prefix([_key(0)]) == 1  # looks like a hit: right key, right length
    _refused(sb)
    assert isinstance(sb.last_refusal, CodecParamsError) and "tp_rank" in str(sb.last_refusal)
    liar = BlockFormat(spec)  # rank 0's fingerprint and rank, but the bytes of heads [1, 2)
    liar.identity = replace(liar.identity, head_lo=1, head_hi=2)
    _, sb = _planted(spec, _sealed(liar, block, _key(0)))
    _refused(sb)
    assert "head_lo" in str(sb.last_refusal)
    _, sb = _planted(spec, _sealed(BlockFormat(spec), block, _key(1)))  # a whole value under another key
    _refused(sb)
    assert "key" in str(sb.last_refusal)


def test_a_block_missing_one_layers_v_part_is_refused() -> None:
    spec = _spec()
    fmt = BlockFormat(spec)
    value = _sealed(fmt, _blocks(spec, 1)[0], _key(0))
    env = parse(value)
    v1 = env.parts[-1]
    assert (v1.kind, v1.layer) == (PartKind.V, 1)
    _, sb = _planted(spec, value[: env.header_len + v1.offset])  # cut: header says more than there is
    assert sb.longest_prefix([_key(0)]) == 0  # a stored block of another size is not even a hit
    _refused(sb)
    assert isinstance(sb.last_refusal, CorruptPayloadError)
    body = value[env.header_len : env.header_len + v1.offset].tobytes()  # written that way: consistent header
    short = reseal(value.tobytes(), body, [(p.kind, p.layer, p.sub, p.length) for p in env.parts[:-1]])
    _, sb = _planted(spec, short)
    _refused(sb)
    kinds = [(p.kind, p.layer, p.sub, p.length) for p in env.parts[:-1]]
    padded = reseal(value.tobytes(), body + bytes(v1.length),  # the right length, the last part mislabelled
                    [*kinds, (PartKind.EXTRA, 0xFFFF, 0, v1.length)])
    assert len(padded) == fmt.value_bytes
    _, sb = _planted(spec, padded)
    assert sb.longest_prefix([_key(0)]) == 1
    _refused(sb)
    assert "V of layer 1" in str(sb.last_refusal)


def test_a_part_swapped_with_another_blocks_is_refused() -> None:
    spec = _spec()
    fmt = BlockFormat(spec)
    blocks = _blocks(spec, 2)
    a, b = _sealed(fmt, blocks[0], _key(0)), _sealed(fmt, blocks[1], _key(1))
    k1 = fmt.parts[2]  # K of layer 1: same offset and length in both blocks
    h = fmt.header_len
    mixed = a.copy()
    mixed[h + k1.offset : h + k1.offset + k1.length] = b[h + k1.offset : h + k1.offset + k1.length]
    _, sb = _planted(spec, mixed)
    _refused(sb)
    assert "K of layer 1 fails its check" in str(sb.last_refusal)
    entry = 72 + 24 * 2  # its manifest entry (digest included) swapped in too: the header check fails
    mixed[entry : entry + 24] = b[entry : entry + 24]
    _, sb = _planted(spec, mixed)
    _refused(sb)


def test_old_blocks_without_an_envelope_are_a_clean_miss() -> None:
    spec = _spec()
    old = _blocks(spec, 1)[0].numpy().reshape(-1).view(np.uint8).copy()  # what kvport stored before
    _, sb = _planted(spec, old)
    assert sb.longest_prefix([_key(0)]) == 0
    _refused(sb)
    assert "no block envelope" in str(sb.last_refusal)
    padded = np.zeros(stored_bytes(spec), np.uint8)  # even at the sealed length
    padded[: old.nbytes] = old
    _, sb = _planted(spec, padded)
    assert sb.longest_prefix([_key(0)]) == 1
    _refused(sb)


def test_a_refused_host_copy_falls_back_to_a_good_copy_below(tmp_path: Path) -> None:
    spec = _spec()
    fmt = BlockFormat(spec)
    vb = fmt.value_bytes
    host, disk = HostTier(4 * vb, vb, name="host"), DiskTier(tmp_path, 1 << 20, name="disk")
    store = TieredStore([host, disk], tier_policies={"disk": TierPolicy(write=WriteMode.THROUGH)})
    block = _blocks(spec, 1)[0]
    good = _sealed(fmt, block, _key(0))
    store.put(_key(0), good)
    bad = good.copy()
    bad[-1] ^= 1
    host.put(_key(0), bad)  # the host copy rots under the store
    sb = StoreBlocks(store, spec)
    out = torch.empty((1, *spec.block_shape))
    sb.read_into([_key(0)], out)
    assert torch.equal(out[0], block) and isinstance(sb.last_refusal, CorruptPayloadError)
    assert store.where(_key(0))[-1] == "disk"


def test_tier_blocks_seal_and_refuse() -> None:
    spec = _spec()
    vb = stored_bytes(spec)
    tier = HostTier(4 * vb, vb)
    tb = TierBlocks(tier, spec)
    blocks = _blocks(spec, 2)
    tb.write([_key(0), _key(1)], blocks, Lifetime.SESSION)
    out = torch.empty_like(blocks)
    tb.read_into([_key(0), _key(1)], out)
    assert torch.equal(out, blocks)
    tier.put(_key(1), tier.get(_key(0)))  # block 0's value under block 1's key
    with pytest.raises(CorruptBlockError):
        tb.read_into([_key(0), _key(1)], out)
    assert not tier.contains(_key(1)) and isinstance(tb.last_refusal, CodecParamsError)


def test_a_store_whose_pages_cannot_hold_a_sealed_block_is_refused() -> None:
    spec = _spec()
    with pytest.raises(EngineError, match="stored_bytes"):
        StoreBlocks(TieredStore([HostTier(4 * spec.bytes_per_block, spec.bytes_per_block)]), spec)
