"""Bytes form for the store and the wire: one canonical LKHTD range in, one self-describing frame out.

A frame is a block envelope (:mod:`kvport.codec.envelope`, body 1) whose parts are the codec's::

    [ envelope header + manifest ]  identity (spec fingerprint, layout, dtype, shape, tp, head range), key
    [ META     ]  msgpack {"id": codec id, "params": {...}}, zero-padded to 8 bytes
    [ SECTION 0 ] [ SECTION 1 ] ...  the codec payload, one part per section (int8: K codes, V codes,
                                     K scales, V scales, K zero points, V zero points; see each codec)

each part with its own xxh3_64. The source is ``(layers, 2, heads, tokens, dim)`` in the spec's dtype
(``spec.block_shape`` when ``tokens == block_size``). :func:`decode_block` checks, before writing
anything: the envelope (caps, lengths, header digest, identity against the spec and the key), the
META part's digest and then its msgpack (size-capped, no pickle), the codec it names, the sections
against the ones that codec writes for that shape (none missing, none extra, same sizes), every
part's digest, the shape against the destination; then it writes exactly the destination's bytes.
Every failure is a :class:`~kvport.errors.CodecError`, which callers treat as a miss (recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from kvport import memops
from kvport.codec.base import Codec, KVShape, check_against_spec, np_dtype
from kvport.codec.envelope import (
    ALL_LAYERS,
    KEY_BYTES,
    Body,
    Envelope,
    Identity,
    PartKind,
    as_bytes,
    check_identity,
    header_bytes,
    parse,
    tile,
    verify_parts,
    write_header,
)
from kvport.codec.registry import codec_from_dict, codec_to_dict
from kvport.errors import CodecError, CodecParamsError, CorruptPayloadError
from kvport.spec import KVSpec

MAX_META = 4096
MAX_TOKENS = 1 << 24
_NO_KEY = bytes(KEY_BYTES)


@dataclass(frozen=True, slots=True)
class FrameInfo:
    codec_id: str
    params: dict[str, Any]
    shape: KVShape
    header_len: int  # bytes before the codec payload (envelope header and META)
    payload_len: int  # the codec payload's bytes
    envelope: Envelope | None = None

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
    return meta + bytes(-len(meta) % 8)  # sections start 8-aligned


def _parts_count(codec: Codec, shape: KVShape) -> int:
    return 1 + len(codec.section_sizes(shape, codec.max_encoded_size(shape)))


def max_frame_size(codec: Codec, spec: KVSpec, tokens: int | None = None, layers: int | None = None) -> int:
    """Bytes an ``out`` buffer needs for :func:`encode_block`."""
    shape = _shape(spec, tokens, layers)
    return header_bytes(_parts_count(codec, shape)) + len(_meta(codec)) + codec.max_encoded_size(shape)


def encode_block(codec: Codec, spec: KVSpec, src: Any, *, key: bytes | None = None, tokens: int | None = None,
                 layers: int | None = None, out: Any = None) -> memoryview:
    """Frame of the LKHTD range ``src`` (``tokens`` defaults to the block size, ``layers`` to all),
    bound to the block ``key`` (16 bytes; None: unbound, zeros); written into ``out`` (any writable
    buffer of :func:`max_frame_size` bytes) when given. Returns a memoryview of exactly the frame."""
    shape = _shape(spec, tokens, layers)
    x = _src_array(src, shape, "src", writable=False)
    meta = _meta(codec)
    hlen = header_bytes(_parts_count(codec, shape))
    at = hlen + len(meta)
    cap = at + codec.max_encoded_size(shape)
    buf = np.empty(cap, np.uint8) if out is None else _src_out(out, cap)
    enc = codec.encode(x[:, 0], x[:, 1], spec, out=buf[at:])
    n = enc.nbytes
    sizes = codec.section_sizes(shape, n)
    if sum(sizes) != n:
        raise CodecParamsError(f"{codec.codec_id}: sections of {sum(sizes)} bytes do not tile its {n}-byte payload")
    parts = tile([(PartKind.META, ALL_LAYERS, 0, len(meta))]
                 + [(PartKind.SECTION, ALL_LAYERS, i, s) for i, s in enumerate(sizes)])
    frame = buf.data.cast("B")[: at + n]
    body = frame[hlen:]
    buf[hlen:at] = np.frombuffer(meta, np.uint8)
    digests = memops.xxh3_many([body[p.offset : p.offset + p.length] for p in parts])
    write_header(frame, Identity.of(spec, tokens=shape.tokens, layers=shape.layers), _NO_KEY if key is None else key,
                 Body.CODEC, parts, digests)
    return frame


def _src_out(out: Any, cap: int) -> np.ndarray:
    try:
        arr = out.reshape(-1).view(np.uint8) if isinstance(out, np.ndarray) else np.frombuffer(out, np.uint8)
    except (TypeError, ValueError) as exc:
        raise CodecParamsError(f"out is not a contiguous buffer: {exc}") from exc
    if arr.nbytes < cap or not arr.flags.writeable:
        raise CodecParamsError(f"out must be a writable buffer of at least {cap} bytes, got {arr.nbytes}")
    return arr


def _unpack_meta(raw: memoryview) -> dict[str, Any]:
    up = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_META + 8, max_str_len=MAX_META,
                          max_bin_len=MAX_META, max_array_len=MAX_META, max_map_len=64)
    try:
        up.feed(raw)
        meta = up.unpack()
        rest = raw[up.tell() :]
    except (ValueError, msgpack.exceptions.OutOfData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError, msgpack.exceptions.BufferFull) as exc:
        raise CorruptPayloadError(f"frame meta is not valid msgpack: {exc}") from exc
    if rest.nbytes >= 8 or any(rest.tobytes()):
        raise CorruptPayloadError("frame meta is followed by bytes that are not its padding")
    if not isinstance(meta, dict) or not isinstance(meta.get("id"), str) or not isinstance(meta.get("params"), dict):
        raise CorruptPayloadError(f"frame meta must be {{'id': str, 'params': dict}}, got {meta!r}")
    return meta


def _open(data: Any, spec: KVSpec | None = None, key: bytes | None = None) -> tuple[memoryview, FrameInfo, Codec]:
    """Envelope (its identity against ``spec`` and ``key`` when given, before anything is sized from
    it), META (verified) and the codec it names; the sections' sizes checked, not their bytes."""
    mv = as_bytes(data)
    env = parse(mv)
    if env.body is not Body.CODEC:
        raise CorruptPayloadError("stored block is raw layout bytes, not a codec frame")
    if spec is not None:
        ident = env.identity
        check_identity(env, Identity.of(spec, tokens=ident.tokens, layers=ident.layers), key)
        if ident.layers > spec.num_layers:
            raise CodecParamsError(f"frame of {ident.layers} layers, the spec has {spec.num_layers}")
    if not env.parts or env.parts[0].kind is not PartKind.META or env.parts[0].length > MAX_META + 8:
        raise CorruptPayloadError("codec frame has no META part (its codec id and params) first")
    body = mv[env.header_len :]
    meta_part = env.parts[0]
    verify_parts(body, env.parts[:1], env.digests[:1])
    meta = _unpack_meta(body[: meta_part.length])
    c = codec_from_dict({"id": meta["id"], "params": meta["params"]})
    ident = env.identity
    if ident.tokens > MAX_TOKENS:
        raise CorruptPayloadError(f"frame of {ident.tokens} tokens exceeds the cap of {MAX_TOKENS}")
    try:
        shape = KVShape(ident.layers, ident.head_hi - ident.head_lo, ident.tokens, ident.head_dim, ident.dtype)
    except CodecParamsError as exc:
        raise CorruptPayloadError(f"frame shape: {exc}") from exc
    plen = env.payload_len - meta_part.length
    if plen > c.max_encoded_size(shape):
        raise CorruptPayloadError(f"{c.codec_id}: payload of {plen} bytes exceeds its bound for {shape.dims}")
    want = c.section_sizes(shape, plen)
    got = env.parts[1:]
    if len(got) != len(want) or any(p.kind is not PartKind.SECTION or p.sub != i or p.length != s
                                    for i, (p, s) in enumerate(zip(got, want, strict=True))):
        raise CorruptPayloadError(f"{c.codec_id} frame: sections {[(p.kind.name, p.sub, p.length) for p in got]} are "
                                  f"not the codec's {list(want)} (a section missing, or of another codec)")
    info = FrameInfo(c.codec_id, dict(c.params), shape, env.header_len + meta_part.length, plen, env)
    return mv, info, c


def peek_header(data: Any) -> FrameInfo:
    """Parse and check a frame's envelope and META (not its sections' bytes) without decoding."""
    return _open(data)[1]


def decode_block(data: Any, spec: KVSpec, dst: Any, *, key: bytes | None = None,
                 codec: Codec | None = None) -> FrameInfo:
    """Validate the frame ``data`` fully, then decode it into ``dst`` (a writable buffer of exactly the
    LKHTD range's bytes). ``key``, when given, must be the key the frame was written under; ``codec``,
    when given, must be the one that wrote it."""
    mv, info, c = _open(data, spec, key)
    assert info.envelope is not None
    env = info.envelope
    check_against_spec(info.shape, spec)
    x = _src_array(dst, info.shape, "dst", writable=True)
    if codec is not None and (codec.codec_id, codec.params) != (c.codec_id, c.params):
        raise CodecParamsError(f"frame was written by {info.codec_id} {info.params}, "
                               f"expected {codec.codec_id} {codec.params}")
    verify_parts(mv[env.header_len :], env.parts[1:], env.digests[1:])
    payload = np.frombuffer(mv, np.uint8, count=info.payload_len, offset=info.header_len)
    try:
        c.decode(payload, x[:, 0], x[:, 1], shape=info.shape)
    except CodecError:
        raise
    except (ValueError, IndexError) as exc:  # defensive: a malformed payload the size checks let through
        raise CorruptPayloadError(f"{info.codec_id}: payload does not decode: {exc}") from exc
    return info
