"""CodecTier: blocks kept encoded under a real DiskTier, decoded into caller buffers, charged at
their encoded size, never wrong data when a frame is damaged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvport.codec import encode_block, get_codec
from kvport.errors import BlockNotFoundError, BufferMismatchError, CorruptBlockError
from kvport.spec import DType, KVSpec
from kvport.store import TieredStore, TierPolicy
from kvport.tiers import CodecTier, DiskTier, HostTier

SPEC = KVSpec(model_id="test/tiny", num_layers=2, num_kv_heads=3, head_dim=64, dtype=DType.BF16, block_size=16)
EXACT = TierPolicy(high_watermark=1.0, low_watermark=1.0)


def _block(seed: int) -> np.ndarray:
    """A bf16 LKHTD block with KV-like values (as uint8 bytes)."""
    x = np.random.default_rng(seed).standard_normal(SPEC.bytes_per_block // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def _f32(raw: bytes | bytearray | np.ndarray) -> np.ndarray:
    return (np.frombuffer(bytes(raw), np.uint16).astype(np.uint32) << 16).view(np.float32)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_lossless_round_trip_is_exact_and_int8_is_close_and_smaller(tmp_path: Path) -> None:
    exact = CodecTier(DiskTier(tmp_path / "a", 1 << 24), get_codec("lossless"), SPEC)
    small = CodecTier(DiskTier(tmp_path / "b", 1 << 24), get_codec("int8"), SPEC)
    b = _block(1)
    exact.put(_key(1), b)
    small.put(_key(1), b)
    out = bytearray(SPEC.bytes_per_block + 7)  # a larger destination: exactly one block is written
    assert exact.get_into(_key(1), out) == SPEC.bytes_per_block
    assert bytes(out[: SPEC.bytes_per_block]) == b.tobytes() and out[SPEC.bytes_per_block :] == bytes(7)
    assert small.get_into(_key(1), out) == SPEC.bytes_per_block
    ref, got = _f32(b), _f32(out[: SPEC.bytes_per_block])
    assert not np.array_equal(ref, got) and np.abs(ref - got).max() < 0.05 * np.abs(ref).max()
    assert small.charge(SPEC.bytes_per_block) < 0.6 * SPEC.bytes_per_block  # what the disk really holds
    assert small.size_of(_key(1)) == SPEC.bytes_per_block and small.size_of(_key(2)) is None


def test_store_demotes_into_the_codec_tier_and_holds_more_blocks_there(tmp_path: Path) -> None:
    bb = SPEC.bytes_per_block
    host = HostTier(2 * bb, bb, name="host")
    cold = CodecTier(DiskTier(tmp_path, 3 * bb, name="disk"), get_codec("int8"), SPEC)
    store = TieredStore([host, cold], tier_policies={"host": EXACT, "disk": EXACT})
    blocks = [_block(i) for i in range(7)]
    for i, b in enumerate(blocks):
        store.put(_key(i), b, parent=_key(i - 1) if i else None)
    res = store.lookup([_key(i) for i in range(7)])
    assert res.prefix_blocks == 7 and res.tiers.count("disk") == 5  # 5 blocks in 3 blocks' worth of disk
    assert cold.used_bytes == 5 * cold.frame_bytes <= 3 * bb
    tiers = {"host": host, "disk": cold}
    for i, where in enumerate(res.tiers):  # each block read from where the lookup says it is
        out = np.zeros(bb, np.uint8)
        assert tiers[where].get_into(_key(i), out) == bb
        ref, got = _f32(blocks[i]), _f32(out)
        assert np.abs(ref - got).max() < 0.05 * np.abs(ref).max()
        assert (where == "host") == np.array_equal(out, blocks[i])  # only the codec tier approximates
    out = np.zeros(bb, np.uint8)
    assert store.get_into(_key(res.tiers.index("disk")), out) == bb  # through the store: decoded too


def test_a_damaged_frame_is_corrupt_then_a_clean_miss() -> None:
    inner = HostTier(1 << 22, 1 << 16)  # keeps bytes as given: only the frame's own checks can see damage
    tier = CodecTier(inner, get_codec("int8"), SPEC)
    frame = bytearray(encode_block(get_codec("int8"), SPEC, _block(3)))
    frame[-5] ^= 0xFF
    inner.put(_key(3), frame)
    out = bytearray(SPEC.bytes_per_block)
    with pytest.raises(CorruptBlockError):
        tier.get_into(_key(3), out)
    assert out == bytearray(SPEC.bytes_per_block)  # nothing was written into the destination
    with pytest.raises(BlockNotFoundError):
        tier.get_into(_key(3), out)


def test_a_frame_of_another_spec_or_codec(tmp_path: Path) -> None:
    inner = HostTier(1 << 22, 1 << 16)
    other = KVSpec(model_id="test/other", num_layers=2, num_kv_heads=3, head_dim=64, dtype=DType.BF16, block_size=16)
    CodecTier(inner, get_codec("int8"), SPEC).put(_key(5), _block(5))
    assert CodecTier(inner, get_codec("lossless"), SPEC).get_into(_key(5), bytearray(SPEC.bytes_per_block)) \
        == SPEC.bytes_per_block  # frames describe themselves: changing a tier's codec keeps its blocks
    b = _block(8)
    CodecTier(inner, get_codec("lossless"), SPEC).put(_key(8), b)  # larger than an int8 frame
    out = bytearray(SPEC.bytes_per_block)
    assert CodecTier(inner, get_codec("int8"), SPEC).get_into(_key(8), out) == SPEC.bytes_per_block
    assert bytes(out) == b.tobytes()  # decoded by the codec that wrote it: exact
    inner.put(_key(6), b"not a frame at all")
    with pytest.raises(CorruptBlockError):
        CodecTier(inner, get_codec("int8"), other).get_into(_key(6), bytearray(SPEC.bytes_per_block))
    assert not inner.contains(_key(6))
    with pytest.raises(BufferMismatchError):
        CodecTier(inner, get_codec("int8"), SPEC).put(_key(7), b"\0" * 100)
