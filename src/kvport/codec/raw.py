"""``raw``: the values as they are. Payload = K then V, each ``[L, H, T, D]`` in the KV dtype."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvport.codec.base import Codec, KVShape, np_dtype
from kvport.codec.registry import register
from kvport.errors import CodecParamsError


@register
class RawCodec(Codec):
    codec_id = "raw"
    lossless = True

    def __init__(self, **params: Any) -> None:
        if params:
            raise CodecParamsError(f"raw takes no params, got {sorted(params)}")

    @property
    def params(self) -> dict[str, Any]:
        return {}

    def max_encoded_size(self, shape: KVShape) -> int:
        return shape.nbytes

    def _encode(self, k: np.ndarray, v: np.ndarray, shape: KVShape, out: np.ndarray,
                importance: np.ndarray | None = None, first_layer: int = 0) -> int:
        half = shape.nbytes // 2
        dt = np_dtype(shape.dtype)
        np.copyto(out[:half].view(dt).reshape(shape.dims), k)
        np.copyto(out[half:2 * half].view(dt).reshape(shape.dims), v)
        return shape.nbytes

    def _decode(self, payload: np.ndarray, shape: KVShape, k_out: np.ndarray, v_out: np.ndarray) -> None:
        half = shape.nbytes // 2
        dt = np_dtype(shape.dtype)
        np.copyto(k_out, payload[:half].view(dt).reshape(shape.dims))
        np.copyto(v_out, payload[half:].view(dt).reshape(shape.dims))
