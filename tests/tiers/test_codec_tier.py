"""CodecTier: blocks kept encoded under a real DiskTier, decoded into caller buffers, charged at
their encoded size, never wrong data when a frame is damaged, missing a part or not the reader's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvport.codec import encode_block, get_codec
from kvport.codec.envelope import BlockFormat
from kvport.errors import BlockNotFoundError, BufferMismatchError, CorruptBlockError
from kvport.spec import DType, KVSpec, Layout
from kvport.store import TieredStore, TierPolicy
from kvport.tiers import CodecTier, DiskTier, HostTier

SPEC = KVSpec(model_id="test/tiny", num_layers=2, num_kv_heads=3, head_dim=64, dtype=DType.BF16, block_size=16)
FMT = BlockFormat(SPEC)
VB = FMT.value_bytes  # a stored block: envelope + the LKHTD bytes
EXACT = TierPolicy(high_watermark=1.0, low_watermark=1.0)


def _raw(seed: int) -> np.ndarray:
    """A bf16 LKHTD block with KV-like values (as uint8 bytes)."""
    x = np.random.default_rng(seed).standard_normal(SPEC.bytes_per_block // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def _block(seed: int, key: bytes | None = None) -> np.ndarray:
    """The raw block of ``seed`` sealed under ``key`` (default: the key of ``seed``), as the store holds it."""
    value = np.zeros(VB, np.uint8)
    FMT.payload(value)[:] = _raw(seed)
    FMT.seal(value, _key(seed) if key is None else key)
    return value


def _payload(value: bytes | bytearray | np.ndarray, key: bytes) -> bytes:
    return bytes(FMT.open(bytes(value), key))


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
    out = bytearray(VB + 7)  # a larger destination: exactly one block is written
    assert exact.get_into(_key(1), out) == VB
    assert bytes(out[:VB]) == b.tobytes() and out[VB:] == bytes(7)  # the same sealed value, envelope and all
    assert small.get_into(_key(1), out) == VB
    ref, got = _f32(_raw(1)), _f32(_payload(out[:VB], _key(1)))  # sealed again over the decoded bytes
    assert not np.array_equal(ref, got) and np.abs(ref - got).max() < 0.05 * np.abs(ref).max()
    assert small.charge(VB) < 0.6 * SPEC.bytes_per_block  # what the disk really holds
    assert small.size_of(_key(1)) == VB and small.size_of(_key(2)) is None


def test_store_demotes_into_the_codec_tier_and_holds_more_blocks_there(tmp_path: Path) -> None:
    bb = VB
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
        ref, got = _f32(_raw(i)), _f32(_payload(out, _key(i)))
        assert np.abs(ref - got).max() < 0.05 * np.abs(ref).max()
        assert (where == "host") == np.array_equal(out, blocks[i])  # only the codec tier approximates
    out = np.zeros(bb, np.uint8)
    assert store.get_into(_key(res.tiers.index("disk")), out) == bb  # through the store: decoded too


def test_a_damaged_frame_is_corrupt_then_a_clean_miss() -> None:
    inner = HostTier(1 << 22, 1 << 16)  # keeps bytes as given: only the frame's own checks can see damage
    tier = CodecTier(inner, get_codec("int8"), SPEC)
    frame = bytearray(encode_block(get_codec("int8"), SPEC, _raw(3), key=_key(3)))
    frame[-5] ^= 0xFF
    inner.put(_key(3), frame)
    out = bytearray(VB)
    with pytest.raises(CorruptBlockError):
        tier.get_into(_key(3), out)
    assert out == bytearray(VB)  # nothing was written into the destination
    with pytest.raises(BlockNotFoundError):
        tier.get_into(_key(3), out)


def test_a_frame_of_another_spec_or_codec(tmp_path: Path) -> None:
    inner = HostTier(1 << 22, 1 << 16)
    other = KVSpec(model_id="test/other", num_layers=2, num_kv_heads=3, head_dim=64, dtype=DType.BF16, block_size=16)
    CodecTier(inner, get_codec("int8"), SPEC).put(_key(5), _block(5))
    assert CodecTier(inner, get_codec("lossless"), SPEC).get_into(_key(5), bytearray(VB)) \
        == VB  # frames describe themselves: changing a tier's codec keeps its blocks
    b = _block(8)
    CodecTier(inner, get_codec("lossless"), SPEC).put(_key(8), b)  # larger than an int8 frame
    out = bytearray(VB)
    assert CodecTier(inner, get_codec("int8"), SPEC).get_into(_key(8), out) == VB
    assert bytes(out) == b.tobytes()  # decoded by the codec that wrote it: exact
    inner.put(_key(6), b"not a frame at all")
    with pytest.raises(CorruptBlockError):
        CodecTier(inner, get_codec("int8"), other).get_into(_key(6), bytearray(VB))
    assert not inner.contains(_key(6))
    with pytest.raises(BufferMismatchError):
        CodecTier(inner, get_codec("int8"), SPEC).put(_key(7), b"\0" * 100)


def _stored_frame(codec_id: str, seed: int, spec: KVSpec = SPEC, key: bytes | None = None) -> bytes:
    return bytes(encode_block(get_codec(codec_id), spec, _raw(seed), key=_key(seed) if key is None else key))


@pytest.mark.parametrize("codec_id", ["raw", "lossless", "int8", "kivi4", "mixed"])
def test_every_codec_round_trips_a_sealed_block(tmp_path: Path, codec_id: str) -> None:
    tier = CodecTier(DiskTier(tmp_path, 1 << 24), get_codec(codec_id), SPEC)
    tier.put_many([(_key(i), _block(i)) for i in range(3)])
    for i in range(3):
        out = np.zeros(VB, np.uint8)
        assert tier.get_into(_key(i), out) == VB
        ref, got = _f32(_raw(i)), _f32(_payload(out, _key(i)))  # a sealed block again, under its key
        assert np.array_equal(ref, got) if get_codec(codec_id).lossless else np.abs(ref - got).max() < 0.5


def _refused(inner: HostTier, key: bytes, frame: bytes) -> None:
    """``frame`` stored under ``key`` reads as corrupt, is dropped, and writes nothing."""
    inner.put(key, frame)
    out = bytearray(VB)
    with pytest.raises(CorruptBlockError):
        CodecTier(inner, get_codec("int8"), SPEC).get_into(key, out)
    assert out == bytearray(VB) and not inner.contains(key)


def test_frames_of_another_rank_head_range_or_key_are_refused() -> None:
    inner = HostTier(1 << 22, 1 << 16)
    tp = SPEC.with_(num_kv_heads=6, tp_size=2)  # same per-rank shape as SPEC (3 heads), other identity
    _refused(inner, _key(1), _stored_frame("int8", 1, tp.with_(tp_rank=1)))  # rank 1: heads [3, 6)
    _refused(inner, _key(1), _stored_frame("int8", 1, tp))  # rank 0 of 2: heads [0, 3) of 6
    _refused(inner, _key(1), _stored_frame("int8", 1, key=_key(2)))  # a whole frame under another key
    _refused(inner, _key(1), _stored_frame("int8", 1, SPEC.with_(revision="other")))


def test_frames_with_scales_or_params_missing_or_of_another_codec_are_refused() -> None:
    from kvport.codec.envelope import parse
    from tests.codec.conftest import reseal, with_meta

    inner = HostTier(1 << 22, 1 << 16)
    frame = _stored_frame("int8", 1)
    env = parse(frame)
    body = frame[env.header_len :]
    kinds = [(p.kind, p.layer, p.sub, p.length) for p in env.parts]
    last = env.parts[-1]  # int8's last section: the V zero points
    _refused(inner, _key(1), reseal(frame, body[: last.offset], kinds[:-1]))  # a section gone, consistently
    scales = env.parts[3]  # K scales: shortened by 8 bytes, the rest shifted up
    cut = body[: scales.offset + scales.length - 8] + body[scales.offset + scales.length :]
    _refused(inner, _key(1), reseal(frame, cut, [*kinds[:3], (scales.kind, scales.layer, scales.sub,
                                                                  scales.length - 8), *kinds[4:]]))
    _refused(inner, _key(1), reseal(frame, body[env.parts[0].length :], kinds[1:]))  # no META (params) part
    _refused(inner, _key(1), with_meta(frame, {"id": "kivi4", "params": {"group": 64}}))  # int8 sections
    _refused(inner, _key(1), with_meta(frame, {"id": "int8", "params": {"bits": 4}}))
    swapped = bytearray(frame)  # K scales and V scales swapped: each part intact, in the other's place
    a, b = env.parts[3], env.parts[4]
    h = env.header_len
    swapped[h + a.offset : h + b.offset + b.length] = body[b.offset : b.offset + b.length] + \
        body[a.offset : a.offset + a.length]
    _refused(inner, _key(1), bytes(swapped))


def test_old_frames_and_unsealed_puts_are_refused() -> None:
    import struct

    inner = HostTier(1 << 22, 1 << 16)
    old = bytearray(40) + _raw(1).tobytes()  # a version-1 frame (magic KVCF, no manifest)
    struct.pack_into("<4sBBHHHIHHIQQ", old, 0, b"KVCF", 1, 1, 0, 2, 3, 16, 64, 0, 0, SPEC.bytes_per_block, 0)
    _refused(inner, _key(1), bytes(old))
    tier = CodecTier(inner, get_codec("int8"), SPEC)
    with pytest.raises(BufferMismatchError):  # the store's value under another key than it was sealed for
        tier.put(_key(2), _block(1))
    broken = _block(1)
    broken[-3] ^= 1
    with pytest.raises(BufferMismatchError):  # a value that fails its own checks is never encoded
        tier.put(_key(1), broken)
    assert not inner.contains(_key(1)) and not inner.contains(_key(2))
    with pytest.raises(BufferMismatchError):  # codecs encode canonical blocks only
        CodecTier(inner, get_codec("int8"), SPEC.with_(layout=Layout.VLLM_CPU))
