"""numba kernels of the ``mixed`` codec (see :mod:`kvport.codec.mixed` for the payload layout).

K middle tokens: each (layer, head, channel) has its own bit width (1..8, from the payload's bit
table); codes of one channel pack along tokens, 8 tokens per ``bits`` bytes. Scale and zero are per
(layer, head, token group, channel), fp16.

V middle tokens: per (layer, token) a class (same codes) shared by the heads; a token's row goes to
the section of its class at ``slot`` = its rank among the middle tokens of that class.

Rotations (params, on by default; exact inverses of each other up to fp32 rounding) are fused into
the kernels: a row is rotated in a small per-call fp32 buffer (a row, or a 64-row tile, in L1) right
after it is loaded, and on decode right before it is stored, so a rotation costs arithmetic but no
pass over memory (separate passes through an fp32 scratch halved the one-thread speed). The vector
code they need (Hadamard butterflies, row min/max, 8-byte code access) is in :mod:`._simd`:

* K, ``cs``/``sn`` with ``rope``: each pair (d, d + D/2) of middle token t turned back by angle
  ``t * f_d`` (the half-split rotary layout of Llama), i.e. keys as before rotary embedding up to one
  fixed rotation per range: channels keep their scale over tokens, which per-channel quantization
  needs. :func:`chan_group_range` and :func:`kbits_encode` both turn each row (recomputing is cheaper
  than storing it), with the same code, so the ranges bound exactly the values quantized.
* V, ``rot``: each row times the orthonormal Walsh-Hadamard matrix (Sylvester order): spreads
  outlier channels over the row, so the per-token range, hence the 4-bit step, shrinks.

K code streams are read and written 8 bytes at a time (unaligned). A chunk's write may spill past
its ``bits`` bytes only into the same channel's later chunks, which are written after it (chunks go
in token order); within 8 bytes of a stream's end (encode) or a layer's end (decode) single bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvport.codec._kernels import affine, f16_bits, f16_value, inline, kernel, load, to_out
from kvport.codec._simd import ld64, row_minmax, st64, wht

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


@inline
def _unrope(x: Any, li: int, h: int, tt: int, cs: Any, sn: Any, t: int, y: Any) -> None:
    """y (fp32) = row ``x[li, h, tt]`` with each pair (d, d + D/2) turned back by the angle of middle
    token t (indexed, not through row views: those do not vectorize as well here)."""
    hd = y.shape[0] // 2
    for d in range(hd):
        y[d] = load(x[li, h, tt, d]) * cs[t, d] + load(x[li, h, tt, d + hd]) * sn[t, d]
    for d in range(hd):
        y[d + hd] = load(x[li, h, tt, d + hd]) * cs[t, d] - load(x[li, h, tt, d]) * sn[t, d]


@kernel
def chan_group_range(x: Any, t_off: int, nt: int, group: int, cs: Any, sn: Any, rope: bool, lo: Any,
                     hi: Any) -> None:
    """lo, hi (L, H, NG, D): min and max of each channel over each group of ``group`` tokens of
    ``x[:, :, t_off:t_off + nt]`` (turned back by ``cs``/``sn`` when ``rope``; the full array is
    passed: contiguous rows vectorize)."""
    nl, nh, _, nd = x.shape
    ng = lo.shape[2]
    y = np.empty(nd, np.float32)
    a = np.empty(nd, np.float32)
    b = np.empty(nd, np.float32)
    for li in range(nl):
        for h in range(nh):
            for g in range(ng):
                for d in range(nd):
                    a[d] = np.float32(np.inf)
                    b[d] = np.float32(-np.inf)
                for t in range(g * group, min(nt, g * group + group)):
                    tt = t_off + t
                    if rope:
                        _unrope(x, li, h, tt, cs, sn, t, y)
                        for d in range(nd):
                            val = y[d]
                            a[d] = a[d] if a[d] < val else val
                            b[d] = b[d] if b[d] > val else val
                    else:
                        for d in range(nd):
                            val = load(x[li, h, tt, d])
                            a[d] = a[d] if a[d] < val else val
                            b[d] = b[d] if b[d] > val else val
                for d in range(nd):
                    lo[li, h, g, d] = a[d]
                    hi[li, h, g, d] = b[d]


@kernel
def kbits_encode(x: Any, t_off: int, nt: int, group: int, cs: Any, sn: Any, rope: bool, lo: Any, hi: Any,
                 bits: Any, offs: Any, q: Any, sbits: Any, zbits: Any) -> None:
    """K middle tokens at ``bits[l, h, d]`` bits per channel (1..8), per channel over token groups.

    Codes of channel d of (l, h) for tokens 8i..8i+7 fill ``bits`` bytes at ``q[l, offs[l, h, d] +
    i * bits]`` (little-endian bit stream, earlier token in lower bits). ``group`` is a multiple of 8,
    so a chunk of 8 tokens never straddles two groups; codes past the last token are 0. Tokens are
    ``x[:, :, t_off:t_off + nt]``, turned back as in :func:`chan_group_range` (the same code, so the
    ranges bound exactly the values quantized)."""
    nl, nh, _, nd = x.shape
    zr = np.empty(nd, np.float32)
    iv = np.empty(nd, np.float32)
    top = np.empty(nd, np.float32)
    y = np.empty(nd, np.float32)
    codes = np.zeros((group, nd), np.uint8)
    acc = np.empty(nd, np.uint64)
    sh = np.empty(nd, np.uint64)
    ends = np.empty(nd, np.int64)
    half = np.float32(0.5)
    zero_f = np.float32(0.0)
    nchunks = (nt + 7) // 8
    ng = sbits.shape[2]
    for li in range(nl):
        qrow = q[li]
        for h in range(nh):
            for d in range(nd):
                nb = bits[li, h, d]
                top[d] = np.float32((1 << nb) - 1)
                sh[d] = np.uint64(nb)
                ends[d] = offs[li, h, d] + nchunks * np.int64(nb)
            for g in range(ng):
                t0 = g * group
                t1 = min(nt, t0 + group)
                for d in range(nd):
                    zb, sb, zf, _sf, inv = affine(lo[li, h, g, d], hi[li, h, g, d], top[d])
                    zbits[li, h, g, d] = zb
                    sbits[li, h, g, d] = sb
                    zr[d] = zf
                    iv[d] = inv
                for t in range(t0, t1):  # indexed, not through row views: 3x faster
                    tt = t_off + t
                    r = t - t0
                    if rope:
                        _unrope(x, li, h, tt, cs, sn, t, y)
                        for d in range(nd):
                            e = np.floor((y[d] - zr[d]) * iv[d] + half)
                            codes[r, d] = np.uint8(min(max(e, zero_f), top[d]))
                    else:
                        for d in range(nd):
                            e = np.floor((load(x[li, h, tt, d]) - zr[d]) * iv[d] + half)
                            codes[r, d] = np.uint8(min(max(e, zero_f), top[d]))
                tend = min(group, (t1 - t0 + 7) // 8 * 8)
                for r in range(t1 - t0, tend):
                    for d in range(nd):
                        codes[r, d] = 0
                for r0 in range(0, tend, 8):
                    for d in range(nd):  # vectorizes: per-lane variable shifts
                        acc[d] = np.uint64(0)
                    for r in range(8):
                        for d in range(nd):
                            acc[d] |= np.uint64(codes[r0 + r, d]) << (sh[d] * np.uint64(r))
                    ci = (t0 + r0) // 8
                    for d in range(nd):
                        nb = np.int64(bits[li, h, d])
                        base = offs[li, h, d] + ci * nb
                        if base + 8 <= ends[d]:  # spills only into this channel's later chunks
                            st64(qrow, base, acc[d])
                        else:
                            a = acc[d]
                            for j in range(nb):
                                qrow[base + j] = np.uint8(a & np.uint64(255))
                                a >>= np.uint64(8)


@kernel
def kbits_decode(q: Any, group: int, bits: Any, offs: Any, sbits: Any, zbits: Any, cs: Any, sn: Any,
                 rope: bool, out: Any, t_off: int, nt: int) -> None:
    """Inverse of :func:`kbits_encode` (turning rows forward again when ``rope``); only rows
    ``t_off..t_off+nt-1`` of ``out`` are written, each once."""
    nl, nh, _, nd = out.shape
    hd = nd // 2
    like = out[0, 0, 0, 0]  # callers never pass an empty destination
    sc = np.empty(nd, np.float32)
    zr = np.empty(nd, np.float32)
    acc = np.empty(nd, np.uint64)
    sh = np.empty(nd, np.uint64)
    mask = np.empty(nd, np.uint64)
    vals = np.empty((8, nd), np.float32)
    ng = sbits.shape[2]
    for li in range(nl):
        qrow = q[li]
        qlen = qrow.shape[0]
        for h in range(nh):
            for d in range(nd):
                sh[d] = np.uint64(bits[li, h, d])
                mask[d] = (np.uint64(1) << sh[d]) - np.uint64(1)
            for g in range(ng):
                t0 = g * group
                t1 = min(nt, t0 + group)
                for d in range(nd):
                    sc[d] = f16_value(sbits[li, h, g, d])
                    zr[d] = f16_value(zbits[li, h, g, d])
                for tc in range(t0, t1, 8):
                    ci = tc // 8
                    for d in range(nd):
                        nb = np.int64(bits[li, h, d])
                        base = offs[li, h, d] + ci * nb
                        if base + 8 <= qlen:
                            acc[d] = ld64(qrow, base)  # bytes past the channel's own are never used
                        else:
                            a = np.uint64(0)
                            for j in range(nb):
                                a |= np.uint64(qrow[base + j]) << np.uint64(8 * j)
                            acc[d] = a
                    for r in range(8):
                        ru = np.uint64(r)
                        for d in range(nd):
                            vals[r, d] = np.float32((acc[d] >> (sh[d] * ru)) & mask[d]) * sc[d] + zr[d]
                    for t in range(tc, min(t1, tc + 8)):  # indexed, not through row views: 2x faster
                        r = t - tc
                        tt = t_off + t
                        if rope:
                            for d in range(hd):
                                out[li, h, tt, d] = to_out(vals[r, d] * cs[t, d] - vals[r, d + hd] * sn[t, d], like)
                            for d in range(hd):
                                out[li, h, tt, d + hd] = to_out(vals[r, d + hd] * cs[t, d] + vals[r, d] * sn[t, d],
                                                                like)
                        else:
                            for d in range(nd):
                                out[li, h, tt, d] = to_out(vals[r, d], like)


@kernel
def vmid_encode(x: Any, t_off: int, rot: bool, cls: Any, slot: Any, q8: Any, s8: Any, z8: Any, q4: Any,
                s4: Any, z4: Any, q2: Any, s2: Any, z2: Any) -> None:
    """Rows ``t_off + t`` (times the orthonormal Hadamard matrix when ``rot``) of class 1 -> int8
    (fp16 scale, uint8 zero point), class 0 -> 4 bits, class 2 -> 2 bits.

    Per (layer, head), blocks of up to 64 rows in three passes over an fp32 tile that stays in L1:
    load (and rotate) + range, then the scales of every row, then quantize + pack. Done row by row,
    each row's range -> fp16 scale -> 1/scale chain (two divides) stalled its quantizer; in a pass of
    its own the rows' chains overlap."""
    nl, nh, _, nd = x.shape
    nt = cls.shape[1]
    blk = 64
    tile = np.empty((blk, nd), np.float32)
    lo = np.empty(blk, np.float32)
    hi = np.empty(blk, np.float32)
    zfs = np.empty(blk, np.float32)
    invs = np.empty(blk, np.float32)
    cq = np.empty(nd, np.uint8)  # codes, then packed through wider views (little-endian)
    c16 = cq.view(np.uint16)
    c32 = cq.view(np.uint32)
    half = np.float32(0.5)
    zero_f = np.float32(0.0)
    sc = np.float32(1.0 / np.sqrt(nd)) if rot else np.float32(1.0)
    for li in range(nl):
        for h in range(nh):
            for t0 in range(0, nt, blk):
                n = min(blk, nt - t0)
                for r in range(n):
                    tt = t_off + t0 + r
                    for d in range(nd):  # indexed, not through row views: those vectorize worse here
                        tile[r, d] = load(x[li, h, tt, d]) * sc
                    y = tile[r]
                    if rot:
                        wht(y)
                    lo[r], hi[r] = row_minmax(y)
                for r in range(n):
                    c = cls[li, t0 + r]
                    k = slot[li, t0 + r]
                    if c == 1:
                        a = min(lo[r], zero_f)
                        b = max(hi[r], zero_f)
                        sb = f16_bits((b - a) / np.float32(255.0))
                        s = f16_value(sb)
                        inv = np.float32(1.0) / s if s > zero_f else zero_f
                        z = min(max(np.rint(-a * inv), zero_f), np.float32(255.0))
                        zfs[r] = -z * s
                        s8[li, h, k] = sb
                        z8[li, h, k] = np.uint8(z)
                    elif c == 0:
                        zb, sb, zfs[r], _sf, inv = affine(lo[r], hi[r], 15.0)
                        s4[li, h, k] = sb
                        z4[li, h, k] = zb
                    else:
                        zb, sb, zfs[r], _sf, inv = affine(lo[r], hi[r], 3.0)
                        s2[li, h, k] = sb
                        z2[li, h, k] = zb
                    invs[r] = inv
                for r in range(n):
                    c = cls[li, t0 + r]
                    k = slot[li, t0 + r]
                    zf = zfs[r]
                    inv = invs[r]
                    if c == 1:
                        for d in range(nd):
                            e = np.floor((tile[r, d] - zf) * inv + half)
                            q8[li, h, k, d] = np.uint8(min(max(e, zero_f), np.float32(255.0)))
                    elif c == 0:
                        for d in range(nd):
                            e = np.floor((tile[r, d] - zf) * inv + half)
                            cq[d] = np.uint8(min(max(e, zero_f), np.float32(15.0)))
                        for j in range(nd // 2):  # dims 2j, 2j + 1 -> low, high nibble
                            w = c16[j]
                            q4[li, h, k, j] = np.uint8((w & np.uint16(0x0F)) | ((w >> np.uint16(4)) & np.uint16(0xF0)))
                    else:
                        for d in range(nd):
                            e = np.floor((tile[r, d] - zf) * inv + half)
                            cq[d] = np.uint8(min(max(e, zero_f), np.float32(3.0)))
                        for j in range(nd // 4):  # dims 4j + u -> bits 2u, 2u + 1
                            w = c32[j]
                            q2[li, h, k, j] = np.uint8((w & np.uint32(0x03)) | ((w >> np.uint32(6)) & np.uint32(0x0C))
                                                       | ((w >> np.uint32(12)) & np.uint32(0x30))
                                                       | ((w >> np.uint32(18)) & np.uint32(0xC0)))


@kernel
def vmid_decode(cls: Any, slot: Any, q8: Any, s8: Any, z8: Any, q4: Any, s4: Any, z4: Any,
                q2: Any, s2: Any, z2: Any, rot: bool, out: Any, t_off: int) -> None:
    """Inverse of :func:`vmid_encode` (times the Hadamard matrix again when ``rot``): writes rows
    ``t_off..t_off+T-1`` of ``out`` only, each once."""
    nl, nh, _, nd = out.shape
    nt = cls.shape[1]
    like = out[0, 0, 0, 0]  # callers never pass an empty destination
    y = np.empty(nd, np.float32)
    cq = np.empty(nd, np.uint8)
    c16 = cq.view(np.uint16)
    c32 = cq.view(np.uint32)
    sc = np.float32(1.0 / np.sqrt(nd))
    for li in range(nl):
        for h in range(nh):
            for t in range(nt):  # rows in memory order
                c = cls[li, t]
                k = slot[li, t]
                if c == 1:
                    s = f16_value(s8[li, h, k])
                    zf = -np.float32(z8[li, h, k]) * s
                    for d in range(nd):
                        y[d] = np.float32(q8[li, h, k, d]) * s + zf
                else:
                    if c == 0:
                        s = f16_value(s4[li, h, k])
                        zf = f16_value(z4[li, h, k])
                        for j in range(nd // 2):
                            b16 = np.uint16(q4[li, h, k, j])
                            c16[j] = (b16 & np.uint16(0x0F)) | ((b16 & np.uint16(0xF0)) << np.uint16(4))
                    else:
                        s = f16_value(s2[li, h, k])
                        zf = f16_value(z2[li, h, k])
                        for j in range(nd // 4):
                            b32 = np.uint32(q2[li, h, k, j])
                            c32[j] = ((b32 & np.uint32(0x03)) | ((b32 & np.uint32(0x0C)) << np.uint32(6))
                                      | ((b32 & np.uint32(0x30)) << np.uint32(12))
                                      | ((b32 & np.uint32(0xC0)) << np.uint32(18)))
                    for d in range(nd):
                        y[d] = np.float32(cq[d]) * s + zf
                tt = t_off + t
                if rot:
                    wht(y)
                    for d in range(nd):
                        out[li, h, tt, d] = to_out(y[d] * sc, like)
                else:
                    for d in range(nd):
                        out[li, h, tt, d] = to_out(y[d], like)
