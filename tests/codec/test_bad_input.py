"""Bad input is a typed error, and a failed decode never writes outside its destination."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvport.codec import decode_block, encode_block, get_codec, peek_header
from kvport.codec.block_frame import max_frame_size
from kvport.errors import CodecError, CodecParamsError, CorruptPayloadError, UnknownCodecError
from kvport.spec import DType, KVSpec
from tests.codec.conftest import kv, with_meta

ALL = ["raw", "lossless", "int8", "kivi4", "mixed"]


def _block(spec: KVSpec, seed: int = 0) -> np.ndarray:
    k, v = kv(layers=spec.num_layers, heads=spec.num_kv_heads, tokens=spec.block_size, seed=seed)
    return torch.stack((k, v), dim=1).contiguous().view(torch.int16).numpy().view(np.uint16)


def test_unknown_codec_and_bad_params() -> None:
    with pytest.raises(UnknownCodecError):
        get_codec("zfp")
    with pytest.raises(CodecParamsError):
        get_codec("int8", bits=4)
    with pytest.raises(CodecParamsError):
        get_codec("kivi4", group=3)
    with pytest.raises(CodecParamsError):
        get_codec("mixed", v_top=1.5)
    with pytest.raises(CodecParamsError):
        get_codec("lossless", level="max")


def test_shapes_that_do_not_match_the_spec(spec: KVSpec) -> None:
    k, v = kv(heads=2)
    with pytest.raises(CodecParamsError):
        get_codec("int8").encode(k, v, spec)
    with pytest.raises(CodecParamsError):
        get_codec("int8").encode(k.float(), v.float(), spec)  # fp32 tensors, bf16 spec
    with pytest.raises(CodecParamsError):
        get_codec("int8").encode(k, v[:, :, :5])
    with pytest.raises(CodecParamsError):
        get_codec("mixed", k_bits=9)  # more bits per K channel than 8
    with pytest.raises(CodecParamsError):
        get_codec("mixed", calib="no-such-model")
    with pytest.raises(CodecParamsError):
        get_codec("mixed", group=12)  # K codes pack 8 tokens at a time: groups are multiples of 8
    with pytest.raises(CodecParamsError):
        get_codec("mixed", k_rope_theta=0.5)
    with pytest.raises(CodecParamsError):
        get_codec("mixed", v_rotate=1)  # a bool, not a truthy number
    with pytest.raises(CodecParamsError):  # the Hadamard rotation (on by default) needs a power-of-two head_dim
        get_codec("mixed").encode(*kv(dim=48))
    assert get_codec("mixed", v_rotate=False).encode(*kv(dim=48)).nbytes > 0  # without it, any D % 4 == 0


@pytest.mark.parametrize("codec_id", ALL)
def test_wrong_destination_is_refused_before_writing(codec_id: str) -> None:
    k, v = kv()
    c = get_codec(codec_id)
    enc = c.encode(k, v)
    with pytest.raises(CodecParamsError):
        c.decode(enc, torch.empty_like(k)[:, :, :-1], torch.empty_like(v))
    with pytest.raises(CodecParamsError):
        c.decode(enc, torch.empty_like(k, dtype=torch.float32), torch.empty_like(v))


@pytest.mark.parametrize("codec_id", ALL)
def test_truncated_payload_is_corrupt(codec_id: str) -> None:
    k, v = kv()
    c = get_codec(codec_id)
    enc = c.encode(k, v)
    ko = torch.full_like(k, 3.0)
    with pytest.raises(CorruptPayloadError):
        c.decode(enc.payload[:-9], ko, torch.empty_like(v), shape=enc.shape)
    assert (ko == 3.0).all()


@pytest.mark.parametrize("codec_id", ALL)
def test_frame_round_trip_and_guard_bytes(codec_id: str, spec: KVSpec) -> None:
    src = _block(spec)
    c = get_codec(codec_id)
    out = bytearray(max_frame_size(c, spec))
    frame = bytes(encode_block(c, spec, src, out=out))
    info = peek_header(frame)
    assert info.codec_id == codec_id and info.shape.tokens == spec.block_size
    guard = 4096
    arena = np.full(src.nbytes + 2 * guard, 0x5A, np.uint8)
    info2 = decode_block(frame, spec, arena[guard:guard + src.nbytes])
    assert info2.frame_len == len(frame)
    assert (arena[:guard] == 0x5A).all() and (arena[guard + src.nbytes:] == 0x5A).all()
    if c.lossless:
        assert np.array_equal(arena[guard:guard + src.nbytes].view(np.uint16).reshape(src.shape), src)


@pytest.mark.parametrize("codec_id", ALL)
def test_corrupted_or_truncated_frames_are_typed_errors(codec_id: str, spec: KVSpec) -> None:
    c = get_codec(codec_id)
    frame = bytearray(encode_block(c, spec, _block(spec)))
    dst = np.full(spec.bytes_per_block, 0x11, np.uint8)
    bad = []
    flipped = bytearray(frame)
    flipped[-5] ^= 0x40
    bad.append(flipped)
    bad.append(frame[:-1])
    bad.append(frame[:20])
    bad.append(b"XXXX" + frame[4:])
    for data in bad:
        with pytest.raises(CorruptPayloadError):
            decode_block(bytes(data), spec, dst)
    assert (dst == 0x11).all()


def test_frame_meta_naming_an_unknown_codec_or_bad_params(spec: KVSpec) -> None:
    frame = bytes(encode_block(get_codec("kivi4"), spec, _block(spec)))
    dst = np.zeros(spec.bytes_per_block, np.uint8)
    with pytest.raises(CorruptPayloadError, match="META fails its check"):  # edited in place: its digest
        decode_block(frame.replace(b"kivi4", b"kivi5", 1), spec, dst)
    with pytest.raises(UnknownCodecError):  # written that way (digests consistent): the id is refused
        decode_block(with_meta(frame, {"id": "kivi5", "params": {"group": 64}}), spec, dst)
    with pytest.raises(CodecParamsError):
        decode_block(with_meta(frame, {"id": "kivi4", "params": {"grouq": 64}}), spec, dst)
    with pytest.raises(CodecParamsError):  # the caller expected another codec
        decode_block(frame, spec, dst, codec=get_codec("kivi4", group=128))


def test_frame_from_another_spec_or_wrong_destination(spec: KVSpec) -> None:
    frame = bytes(encode_block(get_codec("int8"), spec, _block(spec)))
    other = spec.with_(num_kv_heads=2)
    with pytest.raises(CodecParamsError):
        decode_block(frame, other, np.zeros(other.bytes_per_block, np.uint8))
    with pytest.raises(CodecParamsError):
        decode_block(frame, spec, np.zeros(spec.bytes_per_block - 2, np.uint8))
    with pytest.raises(CodecParamsError):
        decode_block(frame, spec, bytes(spec.bytes_per_block))  # read-only destination
    with pytest.raises(CodecParamsError):
        encode_block(get_codec("int8"), spec.with_(dtype=DType.FP8), bytes(spec.bytes_per_block // 2))


def test_mixed_class_map_is_validated_before_decoding(spec: KVSpec) -> None:
    k, v = kv(tokens=200)
    c = get_codec("mixed")
    enc = c.encode(k, v)
    payload = enc.payload.copy()
    counts = c._counts(enc.shape)  # type: ignore[attr-defined]
    _, sec = c._sections(payload, enc.shape, counts)  # type: ignore[attr-defined]
    sec["vcls"][0, :] = 1  # every token claims 8 bits: the slots would run past the 8-bit section
    ko = torch.full_like(k, 9.0)
    with pytest.raises(CorruptPayloadError):
        c.decode(payload, ko, torch.empty_like(v), shape=enc.shape)
    sec["vcls"][0, :] = 0
    sec["kbits"][0, 0, 0] = 9  # a width the codec never writes
    with pytest.raises(CorruptPayloadError):
        c.decode(payload, ko, torch.empty_like(v), shape=enc.shape)
    sec["kbits"][0, 0, 0] = 8  # a valid width, but the layer's bits no longer add up to the budget
    sec["kbits"][0, 0, 1] = 8
    with pytest.raises(CorruptPayloadError):
        c.decode(payload, ko, torch.empty_like(v), shape=enc.shape)
    assert (ko == 9.0).all()


def test_every_codec_error_is_a_codec_error() -> None:
    for exc in (UnknownCodecError, CodecParamsError, CorruptPayloadError):
        assert issubclass(exc, CodecError)


def test_mixed_rotated_payload_is_validated_before_decoding() -> None:
    """The rotations add no section: a rotated payload is checked like any other (size, bit table)
    before the kernels or the inverse rotations write the destination."""
    k, v = kv(tokens=200)
    c = get_codec("mixed", k_rope_theta=100000.0, v_rotate=True)
    enc = c.encode(k, v)
    ko, vo = torch.full_like(k, 9.0), torch.full_like(v, 9.0)
    with pytest.raises(CorruptPayloadError):
        c.decode(enc.payload[:-8], ko, vo, shape=enc.shape)
    payload = enc.payload.copy()
    _, sec = c._sections(payload, enc.shape, c._counts(enc.shape))  # type: ignore[attr-defined]
    sec["kbits"][1, 2, 3] = 1
    with pytest.raises(CorruptPayloadError):
        c.decode(payload, ko, vo, shape=enc.shape)
    assert (ko == 9.0).all() and (vo == 9.0).all()
    with pytest.raises(CodecParamsError):  # params differ from the encoder's: refused, not misdecoded
        get_codec("mixed", k_rope_theta=None, v_rotate=False).decode(enc, ko, vo)
