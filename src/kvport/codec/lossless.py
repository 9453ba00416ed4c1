"""``lossless``: byte-plane split plus zstd; decodes bit-exactly.

The raw K|V bytes (as in ``raw``) are split into ``itemsize`` planes (plane ``b`` holds byte ``b`` of
every element; for bf16 plane 1 is sign + 7 exponent bits, the compressible part) and each plane is
one zstd frame::

    u32 nplanes | u32 frame_len[nplanes] | frame 0 | frame 1 | ...

The payload size is data-dependent; :meth:`max_encoded_size` bounds it. Decoding checks every frame
length against the payload and every frame's decompressed size against the plane size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from kvport.codec.base import Codec, KVShape, np_dtype
from kvport.codec.registry import register
from kvport.errors import CodecParamsError, CorruptPayloadError

_HEAD = 4


def _zstd_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND(n) plus a margin for the frame header."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0) + 64


@register
class LosslessCodec(Codec):
    codec_id = "lossless"
    lossless = True

    def __init__(self, level: int = 1, **params: Any) -> None:
        if params:
            raise CodecParamsError(f"lossless takes only 'level', got {sorted(params)}")
        if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 19:
            raise CodecParamsError(f"lossless level must be an integer in [1, 19], got {level!r}")
        self.level = level
        self._cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        self._dctx = zstandard.ZstdDecompressor()

    @property
    def params(self) -> dict[str, Any]:
        return {"level": self.level}

    def max_encoded_size(self, shape: KVShape) -> int:
        isz = shape.dtype.itemsize
        plane = shape.values
        return _HEAD * (1 + isz) + isz * _zstd_bound(plane)

    def _planes(self, shape: KVShape) -> tuple[int, int]:
        return shape.dtype.itemsize, shape.values

    def _encode(self, k: np.ndarray, v: np.ndarray, shape: KVShape, out: np.ndarray,
                importance: np.ndarray | None = None, first_layer: int = 0) -> int:
        isz, n = self._planes(shape)
        half = n // 2
        planes = np.empty((isz, n), np.uint8)
        for i, x in enumerate((k, v)):
            b = np.ascontiguousarray(x).view(np.uint8).reshape(half, isz)
            planes[:, i * half:(i + 1) * half] = b.T
        head = out[: _HEAD * (1 + isz)].view("<u4")
        head[0] = isz
        pos = _HEAD * (1 + isz)
        for p in range(isz):
            frame = self._cctx.compress(planes[p].data)
            out[pos:pos + len(frame)] = np.frombuffer(frame, np.uint8)
            head[1 + p] = len(frame)
            pos += len(frame)
        return pos

    def _check_payload(self, payload: np.ndarray, shape: KVShape) -> None:
        isz = shape.dtype.itemsize
        if payload.nbytes < _HEAD * (1 + isz):
            raise CorruptPayloadError(f"lossless: payload of {payload.nbytes} bytes is truncated")
        head = payload[: _HEAD * (1 + isz)].view("<u4")
        if int(head[0]) != isz:
            raise CorruptPayloadError(f"lossless: {int(head[0])} planes, expected {isz}")
        if _HEAD * (1 + isz) + int(head[1:].astype(np.int64).sum()) != payload.nbytes:
            raise CorruptPayloadError("lossless: frame lengths do not add up to the payload size")

    def _decode(self, payload: np.ndarray, shape: KVShape, k_out: np.ndarray, v_out: np.ndarray) -> None:
        isz, n = self._planes(shape)
        half = n // 2
        head = payload[: _HEAD * (1 + isz)].view("<u4")
        planes = np.empty((isz, n), np.uint8)
        pos = _HEAD * (1 + isz)
        for p in range(isz):
            ln = int(head[1 + p])
            try:
                raw = self._dctx.decompress(payload[pos:pos + ln].tobytes(), max_output_size=n)
            except zstandard.ZstdError as exc:
                raise CorruptPayloadError(f"lossless: plane {p} does not decompress: {exc}") from exc
            if len(raw) != n:
                raise CorruptPayloadError(f"lossless: plane {p} holds {len(raw)} bytes, expected {n}")
            planes[p] = np.frombuffer(raw, np.uint8)
            pos += ln
        dt = np_dtype(shape.dtype)
        for i, dst in enumerate((k_out, v_out)):
            elems = np.empty((half, isz), np.uint8)
            elems[...] = planes[:, i * half:(i + 1) * half].T
            np.copyto(dst, elems.view(dt).reshape(shape.dims))
