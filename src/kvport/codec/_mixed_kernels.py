"""numba kernels of the ``mixed`` codec (see :mod:`kvport.codec.mixed` for the payload layout).

K middle tokens: per (layer, head) each channel has a class (0: 4 bits, 1: 8 bits, 2: 2 bits); the
channel order ``perm`` lists class-1 channels, then class-0, then class-2, each ascending. Codes of
one channel pack along tokens: 8 bits one token per byte, 4 bits two, 2 bits four (low bits =
earlier token). Scale and zero are per (layer, head, token group, channel), fp16.

V middle tokens: per (layer, token) a class (same codes) shared by the heads; a token's row goes to
the section of its class at ``slot`` = its rank among the middle tokens of that class.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvport.codec._kernels import affine, f16_bits, f16_value, kernel, load, row_range, to_out

BITS = (4, 8, 2)  # bits of class 0, 1, 2


@kernel
def chan_range(x: Any, out: Any) -> None:
    """out (L, H, D) = max - min of each channel over all tokens of x."""
    nl, nh, nt, nd = x.shape
    lo = np.empty(nd, np.float32)
    hi = np.empty(nd, np.float32)
    for li in range(nl):
        for h in range(nh):
            for d in range(nd):
                lo[d] = np.float32(np.inf)
                hi[d] = np.float32(-np.inf)
            for t in range(nt):
                for d in range(nd):
                    val = load(x[li, h, t, d])
                    lo[d] = lo[d] if lo[d] < val else val
                    hi[d] = hi[d] if hi[d] > val else val
            for d in range(nd):
                out[li, h, d] = hi[d] - lo[d]


@kernel
def token_norms(x: Any, out: Any) -> None:
    """out (L, T) = squared L2 norm of each token over heads and dims."""
    nl, nh, nt, nd = x.shape
    for li in range(nl):
        for t in range(nt):
            acc = np.float32(0.0)
            for h in range(nh):
                for d in range(nd):
                    val = load(x[li, h, t, d])
                    acc += val * val
            out[li, t] = acc


@kernel
def kmid_encode(x: Any, group: int, perm: Any, n8: int, n4: int, q8: Any, q4: Any, q2: Any,
                sbits: Any, zbits: Any) -> None:
    """Each (layer, head, group) tile is quantized in channel order into an L1 scratch of codes
    (vectorized over channels), then packed by class through ``perm``."""
    nl, nh, nt, nd = x.shape
    lo = np.empty(nd, np.float32)
    hi = np.empty(nd, np.float32)
    zr = np.empty(nd, np.float32)
    iv = np.empty(nd, np.float32)
    top = np.empty(nd, np.float32)
    codes = np.zeros((group, nd), np.uint8)
    half = np.float32(0.5)
    zero_f = np.float32(0.0)
    ng = sbits.shape[2]
    n2 = nd - n8 - n4
    for li in range(nl):
        for h in range(nh):
            p = perm[li, h]
            for j in range(nd):
                top[p[j]] = np.float32(255.0) if j < n8 else (np.float32(15.0) if j < n8 + n4 else np.float32(3.0))
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
                    zb, sb, zf, _sf, inv = affine(lo[d], hi[d], top[d])
                    zbits[li, h, g, d] = zb
                    sbits[li, h, g, d] = sb
                    zr[d] = zf
                    iv[d] = inv
                for t in range(t0, t1):
                    r = t - t0
                    for d in range(nd):
                        y = np.floor((load(x[li, h, t, d]) - zr[d]) * iv[d] + half)
                        codes[r, d] = np.uint8(min(max(y, zero_f), top[d]))
                for r in range(t1 - t0, min(group, (t1 - t0 + 3) // 4 * 4)):
                    for d in range(nd):
                        codes[r, d] = 0
                for t in range(t0, t1):
                    r = t - t0
                    for j in range(n8):
                        q8[li, h, t, j] = codes[r, p[j]]
                for i in range(t0 // 2, (t1 + 1) // 2):
                    r = 2 * i - t0
                    for j in range(n4):
                        c = p[n8 + j]
                        q4[li, h, i, j] = codes[r, c] | (codes[r + 1, c] << np.uint8(4))
                for i in range(t0 // 4, (t1 + 3) // 4):
                    r = 4 * i - t0
                    for j in range(n2):
                        c = p[n8 + n4 + j]
                        q2[li, h, i, j] = (codes[r, c] | (codes[r + 1, c] << np.uint8(2))
                                           | (codes[r + 2, c] << np.uint8(4)) | (codes[r + 3, c] << np.uint8(6)))


@kernel
def kmid_decode(q8: Any, q4: Any, q2: Any, group: int, perm: Any, n8: int, n4: int, sbits: Any, zbits: Any,
                out: Any) -> None:
    """Unpack a tile's codes into an L1 scratch through ``perm``, then dequantize it in channel order.
    Only rows ``t0..t1-1`` of ``out`` are written."""
    nl, nh, nt, nd = out.shape
    like = out[0, 0, 0, 0]  # callers never pass an empty destination
    sc = np.empty(nd, np.float32)
    zr = np.empty(nd, np.float32)
    codes = np.zeros((group, nd), np.uint8)
    ng = sbits.shape[2]
    n2 = nd - n8 - n4
    m4 = np.uint8(15)
    m2 = np.uint8(3)
    for li in range(nl):
        for h in range(nh):
            p = perm[li, h]
            for g in range(ng):
                t0 = g * group
                t1 = min(nt, t0 + group)
                for d in range(nd):
                    sc[d] = f16_value(sbits[li, h, g, d])
                    zr[d] = f16_value(zbits[li, h, g, d])
                for t in range(t0, t1):
                    r = t - t0
                    for j in range(n8):
                        codes[r, p[j]] = q8[li, h, t, j]
                for i in range(t0 // 2, (t1 + 1) // 2):
                    r = 2 * i - t0
                    for j in range(n4):
                        c = p[n8 + j]
                        b = q4[li, h, i, j]
                        codes[r, c] = b & m4
                        codes[r + 1, c] = b >> np.uint8(4)
                for i in range(t0 // 4, (t1 + 3) // 4):
                    r = 4 * i - t0
                    for j in range(n2):
                        c = p[n8 + n4 + j]
                        b = q2[li, h, i, j]
                        codes[r, c] = b & m2
                        codes[r + 1, c] = (b >> np.uint8(2)) & m2
                        codes[r + 2, c] = (b >> np.uint8(4)) & m2
                        codes[r + 3, c] = b >> np.uint8(6)
                for t in range(t0, t1):
                    r = t - t0
                    for d in range(nd):
                        out[li, h, t, d] = to_out(np.float32(codes[r, d]) * sc[d] + zr[d], like)


@kernel
def vmid_encode(x: Any, cls: Any, slot: Any, q8: Any, s8: Any, z8: Any, q4: Any, s4: Any, z4: Any,
                q2: Any, s2: Any, z2: Any) -> None:
    """Rows of class 1 -> int8 (fp16 scale, uint8 zero point), class 0 -> 4 bits, class 2 -> 2 bits."""
    nl, nh, nt, nd = x.shape
    lo8 = np.empty(8, np.float32)
    hi8 = np.empty(8, np.float32)
    half = np.float32(0.5)
    zero_f = np.float32(0.0)
    for li in range(nl):
        for t in range(nt):
            c = cls[li, t]
            k = slot[li, t]
            for h in range(nh):
                row = x[li, h, t]
                lo, hi = row_range(row, lo8, hi8)
                if c == 1:
                    lo = min(lo, zero_f)
                    hi = max(hi, zero_f)
                    b = f16_bits((hi - lo) / np.float32(255.0))
                    s = f16_value(b)
                    inv = np.float32(1.0) / s if s > zero_f else zero_f
                    z = min(max(np.rint(-lo * inv), zero_f), np.float32(255.0))
                    zf = -z * s
                    for d in range(nd):
                        y = np.floor((load(row[d]) - zf) * inv + half)
                        q8[li, h, k, d] = np.uint8(min(max(y, zero_f), np.float32(255.0)))
                    s8[li, h, k] = b
                    z8[li, h, k] = np.uint8(z)
                elif c == 0:
                    zb, sb, zf, _sf, inv = affine(lo, hi, 15.0)
                    for j in range(nd // 2):
                        a = np.floor((load(row[2 * j]) - zf) * inv + half)
                        e = np.floor((load(row[2 * j + 1]) - zf) * inv + half)
                        q4[li, h, k, j] = (np.uint8(min(max(a, zero_f), np.float32(15.0)))
                                          | (np.uint8(min(max(e, zero_f), np.float32(15.0))) << np.uint8(4)))
                    s4[li, h, k] = sb
                    z4[li, h, k] = zb
                else:
                    zb, sb, zf, _sf, inv = affine(lo, hi, 3.0)
                    for j in range(nd // 4):
                        acc = np.uint8(0)
                        for s in range(4):
                            a = np.floor((load(row[4 * j + s]) - zf) * inv + half)
                            acc |= np.uint8(min(max(a, zero_f), np.float32(3.0))) << np.uint8(2 * s)
                        q2[li, h, k, j] = acc
                    s2[li, h, k] = sb
                    z2[li, h, k] = zb


@kernel
def vmid_decode(cls: Any, slot: Any, q8: Any, s8: Any, z8: Any, q4: Any, s4: Any, z4: Any,
                q2: Any, s2: Any, z2: Any, out: Any) -> None:
    nl, nh, nt, nd = out.shape
    like = out[0, 0, 0, 0]  # callers never pass an empty destination
    for li in range(nl):
        for t in range(nt):
            c = cls[li, t]
            k = slot[li, t]
            for h in range(nh):
                if c == 1:
                    s = f16_value(s8[li, h, k])
                    zf = -np.float32(z8[li, h, k]) * s
                    for d in range(nd):
                        out[li, h, t, d] = to_out(np.float32(q8[li, h, k, d]) * s + zf, like)
                elif c == 0:
                    s = f16_value(s4[li, h, k])
                    zf = f16_value(z4[li, h, k])
                    for j in range(nd // 2):
                        byte = q4[li, h, k, j]
                        out[li, h, t, 2 * j] = to_out(np.float32(byte & np.uint8(15)) * s + zf, like)
                        out[li, h, t, 2 * j + 1] = to_out(np.float32(byte >> np.uint8(4)) * s + zf, like)
                else:
                    s = f16_value(s2[li, h, k])
                    zf = f16_value(z2[li, h, k])
                    for j in range(nd // 4):
                        byte = q2[li, h, k, j]
                        for u in range(4):
                            val = np.float32((byte >> np.uint8(2 * u)) & np.uint8(3))
                            out[li, h, t, 4 * j + u] = to_out(val * s + zf, like)
