"""Payload sections and fp16 scale handling shared by the quantizing codecs.

A payload is a concatenation of fixed-size sections whose sizes follow from the shape and params
alone, each starting at an 8-byte aligned offset::

    payload = [section 0][pad to 8][section 1][pad to 8] ...

:class:`Sections` carves typed, exactly sized views out of one ``uint8`` buffer; the same call
order on the encode and decode sides yields the same offsets, and the total is the payload size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FP16_MAX = 65504.0


def _align(n: int) -> int:
    return (n + 7) & ~7


class Sections:
    """Lay out ``(dtype, shape)`` sections over ``buf`` (or only count bytes when ``buf`` is None)."""

    __slots__ = ("buf", "offset")

    def __init__(self, buf: np.ndarray | None = None) -> None:
        self.buf = buf
        self.offset = 0

    def take(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        start = self.offset
        self.offset = _align(start + n)
        if self.buf is None:
            return np.empty(0, dtype=dt)
        view: np.ndarray = self.buf[start:start + n].view(dt).reshape(shape)
        return view

    @property
    def size(self) -> int:
        return self.offset


def fp16_affine(mn: np.ndarray, mx: np.ndarray, levels: int, scale16: np.ndarray, zero16: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Store fp16 scale and zero for groups with range [mn, mx] at ``levels`` steps; return the fp32
    (scale, zero, 1/scale) that the quantizer must use (exactly what the decoder will read back).

    Ranges beyond fp16 are clipped (values outside are saturated); a constant group gets scale 0,
    inverse 0, and decodes exactly to its zero point."""
    np.clip(mn, -FP16_MAX, FP16_MAX, out=mn)
    rng = np.subtract(mx, mn, dtype=np.float32)
    rng *= np.float32(1.0 / levels)
    np.clip(rng, 0.0, FP16_MAX, out=rng)
    scale16[...] = rng
    zero16[...] = mn
    s32 = scale16.astype(np.float32)
    z32 = zero16.astype(np.float32)
    inv = np.zeros_like(s32)
    np.divide(np.float32(1.0), s32, out=inv, where=s32 > 0)
    return s32, z32, inv


def fp16_to_f32(scale16: np.ndarray, zero16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = scale16.astype(np.float32)
    z = zero16.astype(np.float32)
    return s, z


def kernel_input(x: np.ndarray) -> np.ndarray:
    """Kernels read bf16 bit patterns (uint16) or fp32; fp16 is widened to a fp32 copy first."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


class KernelOutput:
    """A destination the kernels can write (uint16 bf16 bits or fp32); for an fp16 destination a
    fp32 scratch is written and narrowed into the caller's array by :meth:`finish`."""

    __slots__ = ("dst", "target")

    def __init__(self, dst: np.ndarray) -> None:
        self.dst = dst
        self.target = np.empty(dst.shape, np.float32) if dst.dtype == np.float16 else dst

    def finish(self) -> None:
        if self.target is not self.dst:
            np.copyto(self.dst, self.target, casting="same_kind")
