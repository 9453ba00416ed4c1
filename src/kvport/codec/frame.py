"""Bytes form for the store and the wire: one canonical LKHTD range in, one self-describing frame out.

Frame layout (little-endian)::

    0   4  magic b"KVCF"          20  4  reserved (0)
    4   1  version (1)            24  8  payload_len
    5   1  dtype code             32  8  xxh3_64(payload)
    6   2  meta_len               40  meta_len bytes  msgpack {"id": codec id, "params": {...}}
    8   2  layers                 ..  payload_len bytes  the codec's payload
    10  2  heads
    12  4  tokens
    16  2  dim
    18  2  reserved (0)

The source is ``(layers, 2, heads, tokens, dim)`` in the spec's dtype (``spec.block_shape`` when
``tokens == block_size``). :func:`decode_block` checks, before writing anything: magic, version,
every length against the frame and against caps, the meta (msgpack, size-capped, no pickle), the
shape against the spec and the destination size, the payload checksum, and the codec's own payload
size; then it writes exactly the destination's bytes. Every failure is a
:class:`~kvport.errors.CodecError`, which callers treat as a miss (recompute).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from kvport.codec.base import Codec, KVShape, check_against_spec, np_dtype
from kvport.codec.registry import codec_from_dict, codec_to_dict
from kvport.errors import CodecError, CodecParamsError, CorruptPayloadError
from kvport.spec import DType, KVSpec

MAGIC = b"KVCF"
VERSION = 1
_FIXED = struct.Struct("<4sBBHHHIHHIQQ")
HEADER_FIXED = _FIXED.size  # 40
MAX_META = 4096
MAX_TOKENS = 1 << 24
_DTYPES = {DType.BF16: 1, DType.FP16: 2, DType.FP32: 3}
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class FrameInfo:
    codec_id: str
    params: dict[str, Any]
    shape: KVShape
    header_len: int
    payload_len: int

    @property
    def frame_len(self) -> int:
        return self.header_len + self.payload_len


def _src_array(src: Any, shape: KVShape, name: str, writable: bool) -> np.ndarray:
    try:
        arr = src.reshape(-1).view(np.uint8) if isinstance(src, np.ndarray) else np.frombuffer(src, np.uint8)
    except (TypeError, ValueError) as exc:
        raise CodecParamsError(f"{name} is not a contiguous buffer: {exc}") from exc
    want = shape.nbytes
    if arr.nbytes != want:
        raise CodecParamsError(f"{name} holds {arr.nbytes} bytes, {shape.dims} {shape.dtype.value} K+V is {want}")
    if writable and not arr.flags.writeable:
        raise CodecParamsError(f"{name} is read-only")
    L, H, T, D = shape.dims
    return arr.view(np_dtype(shape.dtype)).reshape(L, 2, H, T, D)


def _shape(spec: KVSpec, tokens: int | None, layers: int | None) -> KVShape:
    shape = KVShape.of(spec, spec.block_size if tokens is None else tokens, layers)
    check_against_spec(shape, spec)
    if shape.tokens > MAX_TOKENS:
        raise CodecParamsError(f"{shape.tokens} tokens exceed the frame cap of {MAX_TOKENS}")
    return shape


def _meta(codec: Codec) -> bytes:
    meta: bytes = msgpack.packb(codec_to_dict(codec), use_bin_type=True)
    if len(meta) > MAX_META:
        raise CodecParamsError(f"codec params of {len(meta)} bytes exceed {MAX_META}")
    return meta


def max_frame_size(codec: Codec, spec: KVSpec, tokens: int | None = None, layers: int | None = None) -> int:
    """Bytes an ``out`` buffer needs for :func:`encode_block`."""
    shape = _shape(spec, tokens, layers)
    return HEADER_FIXED + len(_meta(codec)) + codec.max_encoded_size(shape)


def encode_block(codec: Codec, spec: KVSpec, src: Any, *, tokens: int | None = None, layers: int | None = None,
                 out: Any = None) -> memoryview:
    """Frame of the LKHTD range ``src`` (``tokens`` defaults to the block size, ``layers`` to all);
    written into ``out`` (any writable buffer of :func:`max_frame_size` bytes) when given. Returns a
    memoryview of exactly the frame."""
    shape = _shape(spec, tokens, layers)
    x = _src_array(src, shape, "src", writable=False)
    meta = _meta(codec)
    hlen = HEADER_FIXED + len(meta)
    cap = hlen + codec.max_encoded_size(shape)
    buf = np.empty(cap, np.uint8) if out is None else _src_out(out, cap)
    enc = codec.encode(x[:, 0], x[:, 1], spec, out=buf[hlen:])
    n = enc.nbytes
    digest = xxhash.xxh3_64_intdigest(enc.payload.data)
    L, H, T, D = shape.dims
    _FIXED.pack_into(buf.data, 0, MAGIC, VERSION, _DTYPES[shape.dtype], len(meta), L, H, T, D, 0, 0, n, digest)
    buf[HEADER_FIXED:hlen] = np.frombuffer(meta, np.uint8)
    return buf.data.cast("B")[: hlen + n]


def _src_out(out: Any, cap: int) -> np.ndarray:
    try:
        arr = out.reshape(-1).view(np.uint8) if isinstance(out, np.ndarray) else np.frombuffer(out, np.uint8)
    except (TypeError, ValueError) as exc:
        raise CodecParamsError(f"out is not a contiguous buffer: {exc}") from exc
    if arr.nbytes < cap or not arr.flags.writeable:
        raise CodecParamsError(f"out must be a writable buffer of at least {cap} bytes, got {arr.nbytes}")
    return arr


def peek_header(data: Any) -> FrameInfo:
    """Parse and check a frame's header (not its payload) without decoding."""
    try:
        buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    except (TypeError, ValueError) as exc:
        raise CorruptPayloadError(f"frame is not a contiguous buffer: {exc}") from exc
    if buf.nbytes < HEADER_FIXED:
        raise CorruptPayloadError(f"frame of {buf.nbytes} bytes is shorter than its {HEADER_FIXED}-byte header")
    magic, ver, dcode, mlen, L, H, T, D, _, _, plen, _ = _FIXED.unpack_from(buf.data, 0)
    if magic != MAGIC:
        raise CorruptPayloadError(f"bad magic {magic!r}")
    if ver != VERSION:
        raise CorruptPayloadError(f"unknown frame version {ver}")
    if dcode not in _DTYPE_OF or mlen > MAX_META or T > MAX_TOKENS or 0 in (L, H, T, D):
        raise CorruptPayloadError(f"bad header fields (dtype {dcode}, meta {mlen}, shape {(L, H, T, D)})")
    hlen = HEADER_FIXED + mlen
    if hlen + plen != buf.nbytes:
        raise CorruptPayloadError(f"frame is {buf.nbytes} bytes, header says {hlen} + {plen}")
    try:
        meta = msgpack.unpackb(buf[HEADER_FIXED:hlen].tobytes(), raw=False, strict_map_key=True,
                               max_str_len=MAX_META, max_bin_len=MAX_META, max_array_len=MAX_META,
                               max_map_len=64)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError) as exc:
        raise CorruptPayloadError(f"frame meta is not valid msgpack: {exc}") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("id"), str) or not isinstance(meta.get("params"), dict):
        raise CorruptPayloadError(f"frame meta must be {{'id': str, 'params': dict}}, got {meta!r}")
    shape = KVShape(L, H, T, D, _DTYPE_OF[dcode])
    return FrameInfo(meta["id"], meta["params"], shape, hlen, plen)


def decode_block(data: Any, spec: KVSpec, dst: Any, *, codec: Codec | None = None) -> FrameInfo:
    """Validate the frame ``data`` fully, then decode it into ``dst`` (a writable buffer of exactly the
    LKHTD range's bytes). ``codec``, when given, must be the one that wrote the frame."""
    info = peek_header(data)
    check_against_spec(info.shape, spec)
    x = _src_array(dst, info.shape, "dst", writable=True)
    c = codec_from_dict({"id": info.codec_id, "params": info.params})
    if codec is not None and (codec.codec_id, codec.params) != (c.codec_id, c.params):
        raise CodecParamsError(f"frame was written by {info.codec_id} {info.params}, "
                               f"expected {codec.codec_id} {codec.params}")
    buf = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    payload = buf[info.header_len:]
    digest = _FIXED.unpack_from(buf.data, 0)[-1]
    if xxhash.xxh3_64_intdigest(payload.data) != digest:
        raise CorruptPayloadError("frame payload fails its checksum")
    try:
        c.decode(payload, x[:, 0], x[:, 1], shape=info.shape)
    except CodecError:
        raise
    except (ValueError, IndexError) as exc:  # defensive: a malformed payload the size checks let through
        raise CorruptPayloadError(f"{info.codec_id}: payload does not decode: {exc}") from exc
    return info
