"""numba kernels of the ``mixed`` codec (see :mod:`kvport.codec.mixed` for the payload layout).

K middle tokens: each (layer, head, channel) has its own bit width (1..8, from the payload's bit
table); codes of one channel pack along tokens, 8 tokens per ``bits`` bytes. Scale and zero are per
(layer, head, token group, channel), fp16.

V middle tokens: per (layer, token) a class (same codes) shared by the heads; a token's row goes to
the section of its class at ``slot`` = its rank among the middle tokens of that class.

Rotations (optional, exact inverses of each other up to fp32 rounding; the encoder writes the rotated
middle tokens into an fp32 scratch that the quantizers read with ``t_off = 0``, the decoder
dequantizes into such a scratch and rotates back into the destination):

* K, ``rope_*``: each pair (d, d + D/2) of middle token t turned back by angle ``t * f_d`` (the
  half-split rotary layout of Llama), i.e. keys as before rotary embedding up to one fixed rotation
  per range: channels keep their scale over tokens, which per-channel quantization needs.
* V, ``wht_*``: each row times the orthonormal Walsh-Hadamard matrix (Sylvester order): spreads
  outlier channels over the row, so the per-token range, hence the 4-bit step, shrinks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvport.codec._kernels import affine, f16_bits, f16_value, inline, kernel, load, row_range, to_out

BITS = (4, 8, 2)  # bits of class 0, 1, 2


@kernel
def token_norms(x: Any, t_off: int, out: Any) -> None:
    """out (L, T) = squared L2 norm of tokens ``t_off..t_off+T-1`` of x over heads and dims."""
    nl, nh, _, nd = x.shape
    nt = out.shape[1]
    for li in range(nl):
        for t in range(nt):
            acc = np.float32(0.0)
            for h in range(nh):
                for d in range(nd):
                    val = load(x[li, h, t_off + t, d])
                    acc += val * val
            out[li, t] = acc


@kernel
def chan_group_range(x: Any, t_off: int, nt: int, group: int, lo: Any, hi: Any) -> None:
    """lo, hi (L, H, NG, D): min and max of each channel over each group of ``group`` tokens of
    ``x[:, :, t_off:t_off + nt]`` (the full array is passed: contiguous rows vectorize)."""
    nl, nh, _, nd = x.shape
    ng = lo.shape[2]
    for li in range(nl):
        for h in range(nh):
            for g in range(ng):
                a = lo[li, h, g]
                b = hi[li, h, g]
                for d in range(nd):
                    a[d] = np.float32(np.inf)
                    b[d] = np.float32(-np.inf)
                for t in range(g * group, min(nt, g * group + group)):
                    row = x[li, h, t_off + t]
                    for d in range(nd):
                        val = load(row[d])
                        a[d] = a[d] if a[d] < val else val
                        b[d] = b[d] if b[d] > val else val


@kernel
def kbits_encode(x: Any, t_off: int, nt: int, group: int, lo: Any, hi: Any, bits: Any, offs: Any, q: Any,
                 sbits: Any, zbits: Any) -> None:
    """K middle tokens at ``bits[l, h, d]`` bits per channel (1..8), per channel over token groups.

    Codes of channel d of (l, h) for tokens 8i..8i+7 fill ``bits`` bytes at ``q[l, offs[l, h, d] +
    i * bits]`` (little-endian bit stream, earlier token in lower bits). ``group`` is a multiple of 8,
    so a chunk of 8 tokens never straddles two groups; codes past the last token are 0. Tokens are
    ``x[:, :, t_off:t_off + nt]``."""
    nl, nh, _, nd = x.shape
    zr = np.empty(nd, np.float32)
    iv = np.empty(nd, np.float32)
    top = np.empty(nd, np.float32)
    codes = np.zeros((group, nd), np.uint8)
    acc = np.empty(nd, np.uint64)
    sh = np.empty(nd, np.uint64)
    half = np.float32(0.5)
    zero_f = np.float32(0.0)
    ng = sbits.shape[2]
    for li in range(nl):
        for h in range(nh):
            for d in range(nd):
                top[d] = np.float32((1 << bits[li, h, d]) - 1)
                sh[d] = np.uint64(bits[li, h, d])
            for g in range(ng):
                t0 = g * group
                t1 = min(nt, t0 + group)
                for d in range(nd):
                    zb, sb, zf, _sf, inv = affine(lo[li, h, g, d], hi[li, h, g, d], top[d])
                    zbits[li, h, g, d] = zb
                    sbits[li, h, g, d] = sb
                    zr[d] = zf
                    iv[d] = inv
                for t in range(t0, t1):
                    r = t - t0
                    row = x[li, h, t_off + t]
                    for d in range(nd):
                        y = np.floor((load(row[d]) - zr[d]) * iv[d] + half)
                        codes[r, d] = np.uint8(min(max(y, zero_f), top[d]))
                tend = min(group, (t1 - t0 + 7) // 8 * 8)
                for r in range(t1 - t0, tend):
                    for d in range(nd):
                        codes[r, d] = 0
                for r0 in range(0, tend, 8):
                    ci = (t0 + r0) // 8
                    for d in range(nd):  # vectorizes: per-lane variable shifts
                        acc[d] = np.uint64(0)
                    for r in range(8):
                        for d in range(nd):
                            acc[d] |= np.uint64(codes[r0 + r, d]) << (sh[d] * np.uint64(r))
                    for d in range(nd):
                        nb = bits[li, h, d]
                        base = offs[li, h, d] + ci * nb
                        a = acc[d]
                        for j in range(nb):
                            q[li, base + j] = np.uint8(a & np.uint64(255))
                            a >>= np.uint64(8)


@kernel
def kbits_decode(q: Any, group: int, bits: Any, offs: Any, sbits: Any, zbits: Any, out: Any, t_off: int,
                 nt: int) -> None:
    """Inverse of :func:`kbits_encode`; only rows ``t_off..t_off+nt-1`` of ``out`` are written."""
    nl, nh, _, nd = out.shape
    like = out[0, 0, 0, 0]  # callers never pass an empty destination
    sc = np.empty(nd, np.float32)
    zr = np.empty(nd, np.float32)
    codes = np.zeros((group, nd), np.float32)
    ng = sbits.shape[2]
    for li in range(nl):
        for h in range(nh):
            for g in range(ng):
                t0 = g * group
                t1 = min(nt, t0 + group)
                for d in range(nd):
                    sc[d] = f16_value(sbits[li, h, g, d])
                    zr[d] = f16_value(zbits[li, h, g, d])
                tend = min(group, (t1 - t0 + 7) // 8 * 8)
                for r0 in range(0, tend, 8):
                    ci = (t0 + r0) // 8
                    for d in range(nd):
                        nb = bits[li, h, d]
                        b = np.uint64(nb)
                        base = offs[li, h, d] + ci * nb
                        acc = np.uint64(0)
                        for j in range(nb):
                            acc |= np.uint64(q[li, base + j]) << np.uint64(8 * j)
                        mask = (np.uint64(1) << b) - np.uint64(1)
                        for r in range(8):
                            codes[r0 + r, d] = np.float32((acc >> (b * np.uint64(r))) & mask)
                for t in range(t0, t1):
                    r = t - t0
                    dst = out[li, h, t_off + t]
                    for d in range(nd):
                        dst[d] = to_out(codes[r, d] * sc[d] + zr[d], like)


@kernel
def vmid_encode(x: Any, t_off: int, cls: Any, slot: Any, q8: Any, s8: Any, z8: Any, q4: Any, s4: Any,
                z4: Any, q2: Any, s2: Any, z2: Any) -> None:
    """Rows ``t_off + t`` of class 1 -> int8 (fp16 scale, uint8 zero point), class 0 -> 4 bits,
    class 2 -> 2 bits."""
    nl, nh, _, nd = x.shape
    nt = cls.shape[1]
    lo8 = np.empty(8, np.float32)
    hi8 = np.empty(8, np.float32)
    half = np.float32(0.5)
    zero_f = np.float32(0.0)
    for li in range(nl):
        for t in range(nt):
            c = cls[li, t]
            k = slot[li, t]
            for h in range(nh):
                row = x[li, h, t_off + t]
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
                q2: Any, s2: Any, z2: Any, out: Any, t_off: int) -> None:
    """Inverse of :func:`vmid_encode`: writes rows ``t_off..t_off+T-1`` of ``out`` only."""
    nl, nh, _, nd = out.shape
    nt = cls.shape[1]
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
                        out[li, h, t_off + t, d] = to_out(np.float32(q8[li, h, k, d]) * s + zf, like)
                elif c == 0:
                    s = f16_value(s4[li, h, k])
                    zf = f16_value(z4[li, h, k])
                    for j in range(nd // 2):
                        byte = q4[li, h, k, j]
                        out[li, h, t_off + t, 2 * j] = to_out(np.float32(byte & np.uint8(15)) * s + zf, like)
                        out[li, h, t_off + t, 2 * j + 1] = to_out(np.float32(byte >> np.uint8(4)) * s + zf, like)
                else:
                    s = f16_value(s2[li, h, k])
                    zf = f16_value(z2[li, h, k])
                    for j in range(nd // 4):
                        byte = q2[li, h, k, j]
                        for u in range(4):
                            val = np.float32((byte >> np.uint8(2 * u)) & np.uint8(3))
                            out[li, h, t_off + t, 4 * j + u] = to_out(val * s + zf, like)


@inline
def _wht(y: Any, t8: Any) -> None:
    """In place, unnormalized Walsh-Hadamard transform of a row of 8 * 2^k values: the 8-point
    transform inside each chunk of 8 in registers, then butterflies across chunks, 8 lanes at a time."""
    nd = y.shape[0]
    for a in range(0, nd, 8):
        a0, a1, a2, a3 = y[a], y[a + 1], y[a + 2], y[a + 3]
        a4, a5, a6, a7 = y[a + 4], y[a + 5], y[a + 6], y[a + 7]
        b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
        b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
        c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
        c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
        y[a], y[a + 1], y[a + 2], y[a + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
        y[a + 4], y[a + 5], y[a + 6], y[a + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7
    h = 8
    while h < nd:
        for i in range(0, nd, 2 * h):
            for j0 in range(i, i + h, 8):
                for r in range(8):
                    t8[r] = y[j0 + h + r]
                for r in range(8):
                    p = y[j0 + r]
                    y[j0 + r] = p + t8[r]
                    y[j0 + h + r] = p - t8[r]
        h *= 2


@kernel
def wht_rows(x: Any, t_off: int, out: Any) -> None:
    """out (L, H, M, D) fp32 = rows ``t_off..t_off+M-1`` of x times the orthonormal Hadamard matrix."""
    nl, nh, nt, nd = out.shape
    t8 = np.empty(8, np.float32)
    sc = np.float32(1.0 / np.sqrt(nd))
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):
                row = x[li, h, t_off + t]
                y = out[li, h, t]
                for d in range(nd):
                    y[d] = load(row[d]) * sc
                _wht(y, t8)


@kernel
def wht_rows_out(src: Any, out: Any, t_off: int) -> None:
    """Inverse of :func:`wht_rows` (the matrix is its own inverse): rows of the fp32 scratch ``src``
    (transformed in place) into rows ``t_off..`` of ``out``."""
    nl, nh, nt, nd = src.shape
    like = out[0, 0, 0, 0]  # callers never pass an empty destination
    t8 = np.empty(8, np.float32)
    sc = np.float32(1.0 / np.sqrt(nd))
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):
                y = src[li, h, t]
                _wht(y, t8)
                dst = out[li, h, t_off + t]
                for d in range(nd):
                    dst[d] = to_out(y[d] * sc, like)


@kernel
def rope_rows(x: Any, t_off: int, cs: Any, sn: Any, out: Any) -> None:
    """out (L, H, M, D) fp32 = rows ``t_off..`` of x with each pair (d, d + D/2) of token t turned
    back by the angle whose cosine and sine are ``cs[t, d]``, ``sn[t, d]``."""
    nl, nh, nt, nd = out.shape
    hd = nd // 2
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):
                row = x[li, h, t_off + t]
                o = out[li, h, t]
                c = cs[t]
                s = sn[t]
                for d in range(hd):
                    o[d] = load(row[d]) * c[d] + load(row[d + hd]) * s[d]
                for d in range(hd):
                    o[d + hd] = load(row[d + hd]) * c[d] - load(row[d]) * s[d]


@kernel
def rope_rows_out(src: Any, cs: Any, sn: Any, out: Any, t_off: int) -> None:
    """Inverse of :func:`rope_rows`: rows of the fp32 scratch ``src`` turned forward into rows
    ``t_off..`` of ``out``."""
    nl, nh, nt, nd = src.shape
    hd = nd // 2
    like = out[0, 0, 0, 0]  # callers never pass an empty destination
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):
                r = src[li, h, t]
                dst = out[li, h, t_off + t]
                c = cs[t]
                s = sn[t]
                for d in range(hd):
                    dst[d] = to_out(r[d] * c[d] - r[d + hd] * s[d], like)
                for d in range(hd):
                    dst[d + hd] = to_out(r[d + hd] * c[d] + r[d] * s[d], like)
