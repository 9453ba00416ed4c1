"""``kivi4``: 4-bit KIVI-style. K per channel over groups of ``group`` tokens, V per (head, token).

Payload (sections 8-byte aligned, NG = ceil(T / group))::

    qk      uint8 [L, H, ceil(T/2), D]   two consecutive tokens of one channel per byte (low = even)
    qv      uint8 [L, H, T, D/2]         two consecutive dims of one row per byte (low = even)
    sk, zk  fp16  [L, H, NG, D]          K scale, zero per channel and token group
    sv, zv  fp16  [L, H, T]              V scale, zero per row

``x' = q * scale + zero``. At D = 64 the ratio for long ranges is 3.56 with the default group of 64
tokens (3.66 at group = 128, which costs about a point more perplexity on the reference model);
short ranges pay one K scale/zero per channel per range (a 16-token block: 2.9).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvport.codec import _kernels as kern
from kvport.codec._layout import KernelOutput, Sections, kernel_input
from kvport.codec.base import Codec, KVShape
from kvport.codec.registry import register
from kvport.errors import CodecParamsError


def check_group(group: object, name: str = "group") -> int:
    if not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2 or group > 1 << 16:
        raise CodecParamsError(f"{name} must be an even integer in [2, 65536], got {group!r}")
    return group


def chan4_sections(s: Sections, shape: KVShape, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    L, H, T, D = shape.dims
    ng = -(-T // group)
    return (s.take(np.uint8, (L, H, (T + 1) // 2, D)), s.take(np.float16, (L, H, ng, D)),
            s.take(np.float16, (L, H, ng, D)))


def row4_sections(s: Sections, shape: KVShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    L, H, T, D = shape.dims
    return s.take(np.uint8, (L, H, T, D // 2)), s.take(np.float16, (L, H, T)), s.take(np.float16, (L, H, T))


def quant_chan4(x: np.ndarray, group: int, q: np.ndarray, s16: np.ndarray, z16: np.ndarray) -> None:
    kern.chan_encode4(x, group, q, s16.view(np.uint16), z16.view(np.uint16))


def dequant_chan4(q: np.ndarray, group: int, s16: np.ndarray, z16: np.ndarray, out: np.ndarray) -> None:
    dst = KernelOutput(out)
    kern.chan_dequant4(q, group, s16.astype(np.float32), z16.astype(np.float32), dst.target)
    dst.finish()


def quant_row4(x: np.ndarray, q: np.ndarray, s16: np.ndarray, z16: np.ndarray) -> None:
    kern.row_encode4(x, q, s16.view(np.uint16), z16.view(np.uint16))


def dequant_row4(q: np.ndarray, s16: np.ndarray, z16: np.ndarray, out: np.ndarray) -> None:
    dst = KernelOutput(out)
    kern.row_dequant4(q, s16.astype(np.float32), z16.astype(np.float32), dst.target)
    dst.finish()


@register
class Kivi4Codec(Codec):
    codec_id = "kivi4"

    def __init__(self, group: int = 64, **params: Any) -> None:
        if params:
            raise CodecParamsError(f"kivi4 takes only 'group', got {sorted(params)}")
        self.group = check_group(group)

    @property
    def params(self) -> dict[str, Any]:
        return {"group": self.group}

    def _sections(self, buf: np.ndarray | None, shape: KVShape) -> tuple[Sections, tuple[np.ndarray, ...]]:
        if shape.dim % 2:
            raise CodecParamsError(f"kivi4 needs an even head_dim, got {shape.dim}")
        s = Sections(buf)
        return s, (*chan4_sections(s, shape, self.group), *row4_sections(s, shape))

    def max_encoded_size(self, shape: KVShape) -> int:
        return self._sections(None, shape)[0].size

    def section_sizes(self, shape: KVShape, nbytes: int) -> tuple[int, ...]:
        return tuple(self._sections(None, shape)[0].sizes)  # K codes, scales, zeros; V codes, scales, zeros

    def _encode(self, k: np.ndarray, v: np.ndarray, shape: KVShape, out: np.ndarray,
                importance: np.ndarray | None = None, first_layer: int = 0) -> int:
        s, (qk, sk, zk, qv, sv, zv) = self._sections(out, shape)
        quant_chan4(kernel_input(k), self.group, qk, sk, zk)
        quant_row4(kernel_input(v), qv, sv, zv)
        return s.size

    def _decode(self, payload: np.ndarray, shape: KVShape, k_out: np.ndarray, v_out: np.ndarray) -> None:
        _, (qk, sk, zk, qv, sv, zv) = self._sections(payload, shape)
        dequant_chan4(qk, self.group, sk, zk, k_out)
        dequant_row4(qv, sv, zv, v_out)
