"""Fused one-thread numba kernels shared by the quantizing codecs.

Inputs are 4-D ``(layers, heads, tokens, dim)`` arrays of bf16 *bit patterns* (uint16) or fp32;
bf16 is widened with a shift and an LLVM bitcast, and narrowed with round-to-nearest-even, so no
per-element Python and no temporary fp32 copy of the input exist. Scales and zero points are
computed in fp32, rounded to fp16 *by numpy between two kernel passes* (numba has no CPU fp16), and
the quantizer uses the rounded values, so encode and decode agree exactly on them.

Quantization is asymmetric: ``q = floor((x - zero) * inv + 0.5)`` clamped to ``[0, 2^bits - 1]``,
``x' = q * scale + zero``. Groups:

* head rows       ``row_*``  one (layer, head, token) over dims               (int8, V of kivi4 / mixed)
* channel groups  ``chan_*`` one (layer, head, dim) over ``G`` tokens          (K of kivi4 / mixed)

Packing: 4-bit values of two *consecutive tokens* of one channel share a byte (low nibble = even
token) for channel groups, two *consecutive dims* of one row for head rows; 2-bit packs four.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np

from kvport.extras import require

try:
    from llvmlite import ir  # type: ignore[import-untyped]
    from numba import njit, types  # type: ignore[import-untyped]
    from numba.extending import intrinsic, overload  # type: ignore[import-untyped]
except ImportError:
    require("codecs", "kvport's lossy codecs (int8, kivi4, mixed)")  # not installed: one line naming the extra
    raise  # installed but broken: the original error

_JIT: dict[str, Any] = {"cache": True, "nogil": True, "fastmath": True, "error_model": "numpy"}
F = TypeVar("F", bound=Callable[..., Any])


def kernel(fn: F) -> F:
    """Compile ``fn`` with numba: cached on disk, no GIL, fast math (min/max reductions vectorize)."""
    return cast(F, njit(**_JIT)(fn))


def inline(fn: F) -> F:
    """A numba helper inlined into the kernels that call it."""
    return cast(F, njit(inline="always")(fn))


def _intrinsic(fn: Callable[..., Any]) -> Callable[..., Any]:
    return cast(Callable[..., Any], intrinsic(fn))


def _overload(target: Callable[..., Any]) -> Callable[[F], F]:
    def deco(fn: F) -> F:
        return cast(F, overload(target, jit_options={"inline": "always"})(fn))
    return deco


@_intrinsic
def _bits_to_f32(typingctx: Any, x: Any) -> Any:
    sig = types.float32(types.uint32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@_intrinsic
def _f32_to_bits(typingctx: Any, x: Any) -> Any:
    sig = types.uint32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


def load(x: Any) -> float:  # pragma: no cover - replaced by the overload inside kernels
    raise NotImplementedError


@_overload(load)
def _load_ol(x: Any) -> Any:
    if isinstance(x, types.Integer):
        def impl_bf16(x: Any) -> Any:
            return _bits_to_f32(np.uint32(x) << np.uint32(16))
        return impl_bf16

    def impl_f32(x: Any) -> Any:
        return np.float32(x)
    return impl_f32


def to_out(val: Any, like: Any) -> Any:  # pragma: no cover
    raise NotImplementedError


@_overload(to_out)
def _to_out_ol(val: Any, like: Any) -> Any:
    if isinstance(like, types.Integer):
        def impl_bf16(val: Any, like: Any) -> Any:
            u = _f32_to_bits(val)
            return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return impl_bf16

    def impl_f32(val: Any, like: Any) -> Any:
        return np.float32(val)
    return impl_f32


_F2_24 = np.float32(2.0 ** -24)


@inline
def f16_bits(x: Any) -> Any:
    """fp32 -> fp16 bit pattern, round to nearest even, saturating at +-65504 (NaN -> max):
    bit-identical to numpy's ``astype(np.float16)`` on finite values within range."""
    u = _f32_to_bits(np.float32(x))
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x477FF000):
        return np.uint16(sign | np.uint32(0x7BFF))
    if a >= np.uint32(0x38800000):
        r = a - np.uint32(0x38000000)
        r = r + np.uint32(0xFFF) + ((r >> np.uint32(13)) & np.uint32(1))
        return np.uint16(sign | (r >> np.uint32(13)))
    m = np.rint(_bits_to_f32(a) * np.float32(16777216.0))
    return np.uint16(sign | np.uint32(m))


@inline
def f16_value(b: Any) -> Any:
    """fp16 bit pattern (finite) -> fp32."""
    h = np.uint32(b)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    e = (h >> np.uint32(10)) & np.uint32(0x1F)
    m = h & np.uint32(0x3FF)
    if e == 0:
        v = np.float32(m) * _F2_24
        return -v if sign else v
    return _bits_to_f32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))


@inline
def row_range(row: Any, lo8: Any, hi8: Any) -> Any:
    """(min, max) of a 1-D row, eight independent lanes so that the loop vectorizes."""
    nd = row.shape[0]
    for i in range(8):
        lo8[i] = np.float32(np.inf)
        hi8[i] = np.float32(-np.inf)
    for j in range(0, nd - 7, 8):
        for i in range(8):
            val = load(row[j + i])
            lo8[i] = lo8[i] if lo8[i] < val else val
            hi8[i] = hi8[i] if hi8[i] > val else val
    a = lo8[0]
    b = hi8[0]
    for i in range(1, 8):
        a = a if a < lo8[i] else lo8[i]
        b = b if b > hi8[i] else hi8[i]
    for j in range(nd - nd % 8, nd):
        val = load(row[j])
        a = a if a < val else val
        b = b if b > val else val
    return a, b


@inline
def affine(lo: Any, hi: Any, levels: Any) -> Any:
    """fp16 (zero, scale) bits for range [lo, hi] and the fp32 (zero, scale, 1/scale) they decode to."""
    zb = f16_bits(lo)
    zf = f16_value(zb)
    sb = f16_bits(max(hi - zf, np.float32(0.0)) / np.float32(levels))
    sf = f16_value(sb)
    inv = np.float32(1.0) / sf if sf > np.float32(0.0) else np.float32(0.0)
    return zb, sb, zf, sf, inv


@kernel
def row_encode8(x: Any, q: Any, sbits: Any, zp: Any) -> None:
    """int8 rows: fp16 scale + uint8 zero point per (l, h, t); range widened to include 0."""
    nl, nh, nt, nd = x.shape
    lo8 = np.empty(8, np.float32)
    hi8 = np.empty(8, np.float32)
    half = np.float32(0.5)
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):
                row = x[li, h, t]
                lo, hi = row_range(row, lo8, hi8)
                lo = min(lo, np.float32(0.0))
                hi = max(hi, np.float32(0.0))
                b = f16_bits((hi - lo) / np.float32(255.0))
                s = f16_value(b)
                inv = np.float32(1.0) / s if s > np.float32(0.0) else np.float32(0.0)
                z = min(max(np.rint(-lo * inv), np.float32(0.0)), np.float32(255.0))
                zf = -z * s
                for d in range(nd):
                    y = np.floor((load(row[d]) - zf) * inv + half)
                    q[li, h, t, d] = np.uint8(min(max(y, np.float32(0.0)), np.float32(255.0)))
                sbits[li, h, t] = b
                zp[li, h, t] = np.uint8(z)


@kernel
def row_encode4(x: Any, q: Any, sbits: Any, zbits: Any) -> None:
    """4-bit rows: fp16 scale + fp16 zero per (l, h, t); ``q`` (L, H, T, D/2), low nibble = even dim."""
    nl, nh, nt, nd = x.shape
    lo8 = np.empty(8, np.float32)
    hi8 = np.empty(8, np.float32)
    half = np.float32(0.5)
    fifteen = np.float32(15.0)
    zero_f = np.float32(0.0)
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):
                row = x[li, h, t]
                lo, hi = row_range(row, lo8, hi8)
                zb, sb, zf, _sf, inv = affine(lo, hi, 15.0)
                for j in range(nd // 2):
                    a = np.floor((load(row[2 * j]) - zf) * inv + half)
                    c = np.floor((load(row[2 * j + 1]) - zf) * inv + half)
                    qa = np.uint8(min(max(a, zero_f), fifteen))
                    qc = np.uint8(min(max(c, zero_f), fifteen))
                    q[li, h, t, j] = qa | (qc << np.uint8(4))
                sbits[li, h, t] = sb
                zbits[li, h, t] = zb


@kernel
def chan_encode4(x: Any, group: int, q: Any, sbits: Any, zbits: Any) -> None:
    """K at 4 bits per channel over token groups; ``q`` (L, H, ceil(T/2), D), byte = token 2i |
    token 2i+1 << 4; fp16 scale/zero (L, H, NG, D). ``group`` is even: a byte never straddles groups."""
    nl, nh, nt, nd = x.shape
    lo = np.empty(nd, np.float32)
    hi = np.empty(nd, np.float32)
    zr = np.empty(nd, np.float32)
    iv = np.empty(nd, np.float32)
    half = np.float32(0.5)
    fifteen = np.float32(15.0)
    zero_f = np.float32(0.0)
    ng = sbits.shape[2]
    for li in range(nl):
        for h in range(nh):
            for g in range(ng):
                t0 = g * group
                t1 = min(nt, t0 + group)
                for d in range(nd):
                    lo[d] = np.float32(np.inf)
                    hi[d] = np.float32(-np.inf)
                for t in range(t0, t1):
                    for d in range(nd):
                        val = load(x[li, h, t, d])
                        lo[d] = lo[d] if lo[d] < val else val
                        hi[d] = hi[d] if hi[d] > val else val
                for d in range(nd):
                    zb, sb, zf, _sf, inv = affine(lo[d], hi[d], 15.0)
                    zbits[li, h, g, d] = zb
                    sbits[li, h, g, d] = sb
                    zr[d] = zf
                    iv[d] = inv
                for i in range(t0 // 2, (t1 + 1) // 2):
                    ta = 2 * i
                    if ta + 1 < t1:
                        for d in range(nd):
                            a = np.floor((load(x[li, h, ta, d]) - zr[d]) * iv[d] + half)
                            c = np.floor((load(x[li, h, ta + 1, d]) - zr[d]) * iv[d] + half)
                            qa = np.uint8(min(max(a, zero_f), fifteen))
                            qc = np.uint8(min(max(c, zero_f), fifteen))
                            q[li, h, i, d] = qa | (qc << np.uint8(4))
                    else:
                        for d in range(nd):
                            a = np.floor((load(x[li, h, ta, d]) - zr[d]) * iv[d] + half)
                            q[li, h, i, d] = np.uint8(min(max(a, zero_f), fifteen))


# ---------------------------------------------------------------------- head rows (int8, V)
@kernel
def row_dequant8(q: Any, scale: Any, zero: Any, out: Any) -> None:
    nl, nh, nt, nd = out.shape
    like = out[0, 0, 0, 0]
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):
                z = zero[li, h, t]
                s = scale[li, h, t]
                for d in range(nd):
                    out[li, h, t, d] = to_out(np.float32(q[li, h, t, d]) * s + z, like)


@kernel
def row_dequant4(q: Any, scale: Any, zero: Any, out: Any) -> None:
    nl, nh, nt, nd = out.shape
    like = out[0, 0, 0, 0]
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):
                z = zero[li, h, t]
                s = scale[li, h, t]
                for j in range(nd // 2):
                    byte = q[li, h, t, j]
                    out[li, h, t, 2 * j] = to_out(np.float32(byte & np.uint8(15)) * s + z, like)
                    out[li, h, t, 2 * j + 1] = to_out(np.float32(byte >> np.uint8(4)) * s + z, like)


# ---------------------------------------------------------------------- channel groups (K)
@kernel
def chan_dequant4(q: Any, group: int, scale: Any, zero: Any, out: Any) -> None:
    nl, nh, nt, nd = out.shape
    like = out[0, 0, 0, 0]
    for li in range(nl):
        for h in range(nh):
            for i in range(q.shape[2]):
                g = (2 * i) // group
                t0 = 2 * i
                if t0 + 1 < nt:
                    for d in range(nd):
                        byte = q[li, h, i, d]
                        s = scale[li, h, g, d]
                        z = zero[li, h, g, d]
                        out[li, h, t0, d] = to_out(np.float32(byte & np.uint8(15)) * s + z, like)
                        out[li, h, t0 + 1, d] = to_out(np.float32(byte >> np.uint8(4)) * s + z, like)
                else:
                    for d in range(nd):
                        out[li, h, t0, d] = to_out(np.float32(q[li, h, i, d] & np.uint8(15)) * scale[li, h, g, d]
                                                  + zero[li, h, g, d], like)


