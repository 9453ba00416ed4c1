"""The block envelope: exact bytes, round trips for every layout and codec, refusals of every kind,
and hostile bytes (fuzzed) that never crash, hang, allocate without bound or pass as a block."""

from __future__ import annotations

import struct
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvport import memops
from kvport.codec import KVShape, decode_block, encode_block, get_codec
from kvport.codec.envelope import (
    ALL_LAYERS,
    FIXED_BYTES,
    MAX_PARTS,
    BlockFormat,
    Body,
    Identity,
    PartKind,
    header_bytes,
    parse,
    stored_bytes,
)
from kvport.errors import CodecError, CodecParamsError, CorruptPayloadError
from kvport.spec import DType, KVSpec, Layout, from_preset

SPEC = KVSpec(model_id="test/tiny", num_layers=3, num_kv_heads=4, head_dim=8, dtype=DType.BF16, block_size=4,
              tp_size=2, tp_rank=1)
KEY = bytes(range(16))


def _sealed(spec: KVSpec = SPEC, key: bytes = KEY, seed: int = 0, fmt: BlockFormat | None = None) -> bytearray:
    fmt = fmt or BlockFormat(spec)
    value = bytearray(fmt.value_bytes)
    fmt.payload(value)[:] = np.random.default_rng(seed).integers(0, 256, fmt.payload_len, np.uint8).tobytes()
    fmt.seal(value, key)
    return value


def test_header_bytes_are_where_the_docstring_says() -> None:
    fmt = BlockFormat(SPEC)
    v = _sealed()
    n = 2 * SPEC.num_layers
    h = header_bytes(n)
    assert (FIXED_BYTES, h, h % 64) == (72, 256, 0) and fmt.header_len == h
    assert len(v) == stored_bytes(SPEC) == h + SPEC.bytes_per_block
    fixed = struct.unpack_from("<4sBBBBBBHHHIHHHHIQ16s16s", v, 0)
    assert fixed == (b"KVBE", 1, 0, 1, 1, 0, 0, n, 3, 8, 4, 2, 1, 2, 4, h, SPEC.bytes_per_block,
                     SPEC.fingerprint, KEY)  # lkhtd, bf16, rank 1 of 2 holds KV heads [2, 4)
    part = SPEC.bytes_per_layer_block // 2
    for i in range(n):  # K0 V0 K1 V1 K2 V2, back to back
        entry = struct.unpack_from("<BBHHHIIQ", v, 72 + 24 * i)
        start = h + i * part
        digest = xxhash.xxh3_64_intdigest(bytes(v[start : start + part]))
        assert entry == (1 + i % 2, 0, i // 2, 2, 4, i * part, part, digest)
    assert v[72 + 24 * n : h - 8] == bytes(h - 8 - 72 - 24 * n)
    assert struct.unpack_from("<Q", v, h - 8)[0] == xxhash.xxh3_64_intdigest(bytes(v[: h - 8]))
    env = parse(v)
    assert env.identity == Identity.of(SPEC) and env.key == KEY and env.body is Body.LAYOUT


@pytest.mark.parametrize("spec", [
    SPEC,
    SPEC.with_(layout=Layout.VLLM_CPU),  # one KV slab part per layer
    from_preset("deepseek-v3", tp_size=8, tp_rank=3, block_size=2),  # latent, replicated: all heads
    from_preset("llama-3.1-8b", dtype="fp16", block_size=16, tp_size=4, tp_rank=2),
])
def test_raw_layouts_round_trip(spec: KVSpec) -> None:
    fmt = BlockFormat(spec)
    v = _sealed(spec)
    assert bytes(fmt.open(v, KEY)) == bytes(v[fmt.header_len :])
    kinds = {p.kind for p in fmt.parts}
    assert kinds == ({PartKind.LATENT} if spec.latent else {PartKind.KV} if spec.layout is Layout.VLLM_CPU
                     else {PartKind.K, PartKind.V})
    assert sum(p.length for p in fmt.parts) == spec.bytes_per_block
    assert {(e.head_lo, e.head_hi) for e in [parse(v).identity]} == {spec.head_range}


def test_extra_buffers_are_parts_too() -> None:
    fmt = BlockFormat(SPEC, extras=[(7, 40)])
    v = _sealed(fmt=fmt)
    assert fmt.parts[-1] == replace(fmt.parts[-1], kind=PartKind.EXTRA, layer=ALL_LAYERS, sub=7, length=40)
    assert len(fmt.open(v, KEY)) == SPEC.bytes_per_block + 40
    with pytest.raises(CorruptPayloadError, match="parts"):  # a reader that expects no extra buffer
        BlockFormat(SPEC).open(v, KEY)
    with pytest.raises(CodecParamsError):
        BlockFormat(SPEC.with_(layout=Layout.HF))  # not a stored layout


@pytest.mark.parametrize("codec_id", ["raw", "lossless", "int8", "kivi4", "mixed"])
def test_codec_frames_round_trip_and_list_their_sections(codec_id: str) -> None:
    spec = SPEC.with_(tp_size=1, tp_rank=0, num_kv_heads=2, head_dim=64, block_size=16)
    src = np.random.default_rng(1).standard_normal(spec.bytes_per_block // 2).astype(np.float32)
    src = (src.view(np.uint32) >> 16).astype(np.uint16)
    c = get_codec(codec_id)
    frame = bytes(encode_block(c, spec, src, key=KEY))
    env = parse(frame)
    assert env.body is Body.CODEC and env.parts[0].kind is PartKind.META
    assert [p.kind for p in env.parts[1:]] == [PartKind.SECTION] * (len(env.parts) - 1)
    sizes = c.section_sizes(KVShape.of(spec, 16), env.payload_len - env.parts[0].length)
    assert [p.length for p in env.parts[1:]] == list(sizes)
    dst = np.zeros_like(src)
    decode_block(frame, spec, dst, key=KEY)
    if c.lossless:
        assert np.array_equal(dst, src)
    with pytest.raises(CodecParamsError, match="key"):
        decode_block(frame, spec, dst, key=bytes(16))
    with pytest.raises(CodecParamsError, match="tp_size"):
        decode_block(frame, spec.with_(num_kv_heads=4, tp_size=2), dst)


@pytest.mark.parametrize(("change", "field"), [
    ({"tp_rank": 0}, "tp_rank"), ({"layout": Layout.VLLM_CPU}, "layout"), ({"revision": "r2"}, "fingerprint"),
    ({"num_kv_heads": 2, "tp_size": 1, "tp_rank": 0}, "tp_size"), ({"dtype": DType.FP16}, "dtype"),
])
def test_a_block_of_another_identity_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(CodecParamsError, match=f"another {field}"):
        BlockFormat(SPEC.with_(**change)).open(_sealed(), KEY)
    with pytest.raises(CodecParamsError, match="key"):
        BlockFormat(SPEC).open(_sealed(), bytes(16))


def test_damage_of_every_kind_is_refused() -> None:
    fmt = BlockFormat(SPEC)
    v = _sealed()
    h = fmt.header_len
    with pytest.raises(CorruptPayloadError, match="no block envelope"):
        fmt.open(v[h:], KEY)  # an old block
    with pytest.raises(CorruptPayloadError, match="truncated"):
        fmt.open(v[:-1], KEY)
    flipped = bytearray(v)
    flipped[h + SPEC.bytes_per_layer_block + 3] ^= 1  # in K of layer 1
    with pytest.raises(CorruptPayloadError, match="K of layer 1 fails"):
        fmt.open(flipped, KEY)
    flipped = bytearray(v)
    flipped[100] ^= 1  # a manifest byte
    with pytest.raises(CorruptPayloadError, match="header fails"):
        fmt.open(flipped, KEY)
    other = _sealed(seed=9)
    swapped = bytearray(v)  # V of layer 2 from another block of the same key, consistent length
    p = fmt.parts[-1]
    swapped[h + p.offset :] = other[h + p.offset :]
    with pytest.raises(CorruptPayloadError, match="V of layer 2 fails"):
        fmt.open(swapped, KEY)
    assert bytes(fmt.open(v, KEY)) == bytes(v[h:])  # the original still opens


def _refix_header(v: bytearray) -> None:
    """Recompute the header digest after an edit, so deeper checks get the bytes (a lying writer)."""
    n = struct.unpack_from("<H", v, 10)[0]
    h = min(header_bytes(min(n, MAX_PARTS)), len(v))
    if h >= 8:
        struct.pack_into("<Q", v, h - 8, xxhash.xxh3_64_intdigest(bytes(v[: h - 8])))


_FIELDS = [(10, "<H"), (12, "<H"), (14, "<H"), (16, "<I"), (20, "<H"), (22, "<H"), (24, "<H"), (26, "<H"),
           (28, "<I"), (32, "<Q"), (5, "<B"), (6, "<B"), (7, "<B"), (8, "<B")]


@st.composite
def _mutation(draw: st.DrawFn, size: int, header: int, n_parts: int) -> tuple[str, tuple[int, ...]]:
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "field", "entry"]))
    if kind == "flip":
        return kind, (draw(st.integers(0, size - 1)), draw(st.integers(1, 255)))
    if kind == "truncate":
        return kind, (draw(st.integers(0, size - 1)),)
    if kind == "extend":
        return kind, (draw(st.integers(1, 4096)),)
    if kind == "field":
        i = draw(st.integers(0, len(_FIELDS) - 1))
        bits = 8 * struct.calcsize(_FIELDS[i][1])
        return kind, (i, draw(st.one_of(st.integers(0, 4), st.integers(0, (1 << bits) - 1))))
    entry = draw(st.integers(0, n_parts - 1))
    return kind, (entry, draw(st.integers(0, 23)), draw(st.integers(0, 255)))


def _mutate(v: bytes, m: tuple[str, tuple[int, ...]]) -> bytes:
    kind, a = m
    out = bytearray(v)
    if kind == "flip":
        out[a[0]] ^= a[1]
    elif kind == "truncate":
        del out[a[0] :]
    elif kind == "extend":
        out += bytes(a[0])
    elif kind == "field":
        off, fmt = _FIELDS[a[0]]
        struct.pack_into(fmt, out, off, a[1])
        _refix_header(out)
    else:
        out[72 + 24 * a[0] + a[1]] = a[2]
        _refix_header(out)
    return bytes(out)


_RAW = bytes(_sealed())
_FMT = BlockFormat(SPEC)
_FSPEC = SPEC.with_(tp_size=1, tp_rank=0, num_kv_heads=2, head_dim=64, block_size=16)
_FRAME = bytes(encode_block(get_codec("int8"), _FSPEC, np.ones(_FSPEC.bytes_per_block // 2, np.uint16), key=KEY))


def _bounded(fn: object) -> None:
    """Run ``fn``: a CodecError (or nothing, for unchanged bytes), never another error; peak memory
    bounded (nothing is sized from the stored lengths)."""
    tracemalloc.start()
    try:
        fn()  # type: ignore[operator]
    except CodecError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 4 << 20


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(m=_mutation(len(_RAW), _FMT.header_len, len(_FMT.parts)))
def test_hostile_raw_blocks_never_pass_crash_or_allocate(m: tuple[str, tuple[int, ...]]) -> None:
    bad = _mutate(_RAW, m)
    if bad == _RAW:
        return
    got: list[bytes] = []
    _bounded(lambda: got.append(bytes(_FMT.open(bad, KEY))))
    assert got == []  # any changed byte is refused: nothing is handed to a caller to link


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(m=_mutation(len(_FRAME), parse(_FRAME).header_len, len(parse(_FRAME).parts)))
def test_hostile_codec_frames_never_pass_crash_or_allocate(m: tuple[str, tuple[int, ...]]) -> None:
    bad = _mutate(_FRAME, m)
    if bad == _FRAME:
        return
    dst = np.full(_FSPEC.bytes_per_block, 0x5A, np.uint8)
    _bounded(lambda: decode_block(bad, _FSPEC, dst, key=KEY))
    assert (dst == 0x5A).all()  # nothing written


def test_digests_are_the_native_ones() -> None:
    bufs = [b"", b"a" * 5, bytes(range(256)) * 70]
    assert memops.xxh3_many(bufs) == memops.xxh3_many_py(bufs)
