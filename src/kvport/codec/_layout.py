"""Payload sections and kernel input/output adapters shared by the quantizing codecs.

A payload is a concatenation of fixed-size sections whose sizes follow from the shape and params
alone, each starting at an 8-byte aligned offset::

    payload = [section 0][pad to 8][section 1][pad to 8] ...

:class:`Sections` carves typed, exactly sized views out of one ``uint8`` buffer; the same call
order on the encode and decode sides yields the same offsets, and the total is the payload size.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _align(n: int) -> int:
    return (n + 7) & ~7


class Sections:
    """Lay out ``(dtype, shape)`` sections over ``buf`` (or only count bytes when ``buf`` is None)."""

    __slots__ = ("buf", "offset", "sizes")

    def __init__(self, buf: np.ndarray | None = None) -> None:
        self.buf = buf
        self.offset = 0
        self.sizes: list[int] = []  # each section's bytes with its pad: they tile the payload

    def take(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        start = self.offset
        self.offset = _align(start + n)
        self.sizes.append(self.offset - start)
        if self.buf is None:
            return np.empty(0, dtype=dt)
        view: np.ndarray = self.buf[start:start + n].view(dt).reshape(shape)
        return view

    @property
    def size(self) -> int:
        return self.offset


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
