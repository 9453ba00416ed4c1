"""``mixed``: sinks at 8 bits, K with calibrated bits per channel, V by token importance.

Tokens of a range of T: ``sinks`` first tokens and ``recent`` last tokens keep K and V at 8 bits
(per (layer, head, token) rows, as ``int8``); the M middle tokens are split by component:

* K, per channel over groups of ``group`` tokens (KIVI), with a bit width per (layer, head, channel)
  in 2..8: per layer the ``k_bits * heads * head_dim`` bits are allocated greedily to minimise the
  expected attention-score error ``sum_c E[q_c^2] * step_c^2 / 12``, where ``step_c`` is the
  channel's quantization step (from its ranges over the groups of this range) and ``E[q_c^2]`` the
  mean square of the matching query channel, measured once on calibration text (``calib``; see
  :mod:`kvport.eval.kcalib`). Without a table that fits the shape (or with ``calib=None``) every
  query channel weighs 1. The bit table is stored in the payload (one byte per channel), so decoding
  needs nothing but the payload, the shape and the params; its per-layer sums are fixed by the
  params, so the size is a pure function of shape and params.
* V, per (layer, head, token) row, with bits allocated across *tokens*: per layer the ``v_top``
  share of middle tokens with the largest key norm (or engine-supplied importance, e.g. attention
  mass) get 8 bits, the ``v_low`` share with the smallest 2, the rest 4. ``target_ratio`` (when
  set) replaces ``v_top``: the largest 8-bit share whose ratio still meets the target; when the
  fixed parts alone miss it, more of the least important V tokens drop to 2 bits instead.

Two rotations, on by default (params; neither changes the layout or the size below, and the decoder
applies the exact inverse, so a payload still decodes from its shape and params alone). Both run
inside the quantizing kernels, on rows while they are in cache: no extra pass over memory.

* ``k_rope_theta`` (default 100000, the reference model's; None: off): middle K tokens are turned
  back by their rotary angle (half-split Llama layout, base ``theta``; positions relative to the
  first middle token) before the per-channel quantizer, and forward again on decode: per-channel
  quantization of keys *before* rotary embedding, where a channel's scale is stable over tokens
  (on the reference model: K error -40%).
* ``v_rotate`` (default True; needs head_dim a power of two >= 8, else pass False): middle V rows
  are multiplied by the orthonormal Walsh-Hadamard matrix before the per-token quantizer (and by it
  again on decode): outlier channels are spread over the row.

Payload (sections 8-byte aligned; S, R, M as clipped to T; MC = ceil(M/8) chunks of 8 tokens;
B = round(k_bits * H * D) bits per layer; nv8/nv4/nv2 tokens)::

    hi rows  K sinks, K recent, V sinks, V recent: codes u8 [L,H,n,D], scale f16 [L,H,n], zp u8 [L,H,n]
    kbits    u8  [L, H, D]                 bit width of each K channel (2..8, sum B per layer)
    kq       u8  [L, MC * B]               per layer, (head, channel) in order, MC * bits bytes each
    ks, kz   f16 [L, H, ceil(M/group), D]
    vcls     u8  [L, M]                    class of each middle token's V (1: 8 bits, 0: 4, 2: 2)
    v8 u8 [L,H,nv8,D] + f16 scale + u8 zp;  v4 u8 [L,H,nv4,D/2] + f16 scale, zero;  v2 likewise D/4

Every byte above counts in the ratio. Decoding checks the bit table (widths, per-layer sums) and the
class map (counts) before any kernel runs, so every code offset stays inside its section.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvport.codec import _kernels as kern
from kvport.codec import _mixed_kernels as mk
from kvport.codec._layout import KernelOutput, Sections, kernel_input
from kvport.codec.base import Codec, KVShape
from kvport.codec.registry import register
from kvport.errors import CodecParamsError, CorruptPayloadError

K_MIN_BITS, K_MAX_BITS = 2, 8
CALIB_TABLES = ("smollm2-135m",)


@dataclass(frozen=True, slots=True)
class _Counts:
    s: int
    r: int
    m: int
    kb: int  # K bits per layer
    nv8: int
    nv4: int
    nv2: int


def _int(name: str, v: object, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CodecParamsError(f"mixed: {name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _share(name: str, v: object) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= float(v) <= 1.0:
        raise CodecParamsError(f"mixed: {name} must be a number in [0, 1], got {v!r}")
    return float(v)


@register
class MixedCodec(Codec):
    codec_id = "mixed"

    def __init__(self, group: int = 128, sinks: int = 4, recent: int = 0, k_bits: float = 4.25,
                 calib: str | None = "smollm2-135m", v_top: float = 0.0, v_low: float = 0.0,
                 target_ratio: float | None = None, k_rope_theta: float | None = 100000.0,
                 v_rotate: bool = True, **params: Any) -> None:
        if params:
            raise CodecParamsError(f"mixed: unknown params {sorted(params)}")
        self.group = _int("group", group, 4, 1 << 16)
        if self.group % 8:
            raise CodecParamsError(f"mixed: group must be a multiple of 8, got {group}")
        self.sinks = _int("sinks", sinks, 0, 1 << 16)
        self.recent = _int("recent", recent, 0, 1 << 16)
        if (not isinstance(k_bits, int | float) or isinstance(k_bits, bool)
                or not K_MIN_BITS <= float(k_bits) <= K_MAX_BITS):
            raise CodecParamsError(f"mixed: k_bits must be a number in [{K_MIN_BITS}, {K_MAX_BITS}], got {k_bits!r}")
        self.k_bits = float(k_bits)
        if calib is not None and calib not in CALIB_TABLES:
            raise CodecParamsError(f"mixed: calib must be one of {CALIB_TABLES} or None, got {calib!r}")
        self.calib = calib
        self.v_top = _share("v_top", v_top)
        self.v_low = _share("v_low", v_low)
        if self.v_top + self.v_low > 1.0:
            raise CodecParamsError("mixed: v_top + v_low must not exceed 1")
        if target_ratio is not None and (not isinstance(target_ratio, int | float) or isinstance(target_ratio, bool)
                                         or not 1.0 <= float(target_ratio) <= 16.0):
            raise CodecParamsError(f"mixed: target_ratio must be a number in [1, 16] or None, got {target_ratio!r}")
        self.target_ratio = None if target_ratio is None else float(target_ratio)
        if k_rope_theta is not None and (not isinstance(k_rope_theta, int | float) or isinstance(k_rope_theta, bool)
                                         or not 1.0 < float(k_rope_theta) <= 1e12):
            raise CodecParamsError(f"mixed: k_rope_theta must be a number in (1, 1e12] or None, got {k_rope_theta!r}")
        self.k_rope_theta = None if k_rope_theta is None else float(k_rope_theta)
        if not isinstance(v_rotate, bool):
            raise CodecParamsError(f"mixed: v_rotate must be true or false, got {v_rotate!r}")
        self.v_rotate = v_rotate

    @property
    def params(self) -> dict[str, Any]:
        return {"group": self.group, "sinks": self.sinks, "recent": self.recent, "k_bits": self.k_bits,
                "calib": self.calib, "v_top": self.v_top, "v_low": self.v_low, "target_ratio": self.target_ratio,
                "k_rope_theta": self.k_rope_theta, "v_rotate": self.v_rotate}

    # ------------------------------------------------------------------ sizes
    def _counts(self, shape: KVShape, nv8: int | None = None, nv2: int | None = None) -> _Counts:
        T, D = shape.tokens, shape.dim
        if D % 4:
            raise CodecParamsError(f"mixed needs head_dim divisible by 4, got {D}")
        if self.v_rotate and (D < 8 or D & (D - 1)):
            raise CodecParamsError(f"mixed: v_rotate (on by default) needs head_dim a power of two >= 8, got {D}; "
                                   "pass v_rotate=False")
        kb = min(max(round(self.k_bits * shape.heads * D), K_MIN_BITS * shape.heads * D), K_MAX_BITS * shape.heads * D)
        s = min(self.sinks, T)
        r = min(self.recent, T - s)
        m = T - s - r
        if nv8 is None or nv2 is None:
            if self.target_ratio is not None:
                nv8, nv2 = self._target_split(shape, m)
            else:
                nv8, nv2 = round(self.v_top * m), int(self.v_low * m)
        nv2 = min(nv2, m)
        nv8 = min(nv8, m - nv2)
        return _Counts(s, r, m, kb, nv8, m - nv8 - nv2, nv2)

    def _target_split(self, shape: KVShape, m: int) -> tuple[int, int]:
        """(nv8, nv2) for ``target_ratio``: with the ``v_low`` share at 2 bits, the most 8-bit V tokens
        that still meet the target; if even none do, the fewest 2-bit V tokens that do (all, at worst)."""
        if self.target_ratio is None:
            raise CodecParamsError("mixed: no target_ratio to meet")
        budget = shape.bf16_bytes / self.target_ratio

        def fits(nv8: int, nv2: int) -> bool:
            return self._size(shape, self._counts(shape, nv8, nv2)) <= budget

        nv2 = int(self.v_low * m)
        if fits(0, nv2):
            return _largest(0, m - nv2, lambda n: fits(n, nv2)), nv2
        return 0, _smallest(nv2, m, lambda n: fits(0, n))

    def _sections(self, buf: np.ndarray | None, shape: KVShape, c: _Counts) -> tuple[Sections, dict[str, np.ndarray]]:
        L, H, _, D = shape.dims
        s = Sections(buf)
        sec: dict[str, np.ndarray] = {}
        for part, n in (("ks", c.s), ("kr", c.r), ("vs", c.s), ("vr", c.r)):
            sec[part + "_q"] = s.take(np.uint8, (L, H, n, D))
            sec[part + "_s"] = s.take(np.float16, (L, H, n))
            sec[part + "_z"] = s.take(np.uint8, (L, H, n))
        ng = -(-c.m // self.group)
        sec["kbits"] = s.take(np.uint8, (L, H, D))
        sec["kq"] = s.take(np.uint8, (L, (c.m + 7) // 8 * c.kb))
        sec["ks"] = s.take(np.float16, (L, H, ng, D))
        sec["kz"] = s.take(np.float16, (L, H, ng, D))
        sec["vcls"] = s.take(np.uint8, (L, c.m))
        sec["v8"] = s.take(np.uint8, (L, H, c.nv8, D))
        sec["v8s"] = s.take(np.float16, (L, H, c.nv8))
        sec["v8z"] = s.take(np.uint8, (L, H, c.nv8))
        sec["v4"] = s.take(np.uint8, (L, H, c.nv4, D // 2))
        sec["v4s"] = s.take(np.float16, (L, H, c.nv4))
        sec["v4z"] = s.take(np.float16, (L, H, c.nv4))
        sec["v2"] = s.take(np.uint8, (L, H, c.nv2, D // 4))
        sec["v2s"] = s.take(np.float16, (L, H, c.nv2))
        sec["v2z"] = s.take(np.float16, (L, H, c.nv2))
        return s, sec

    def _size(self, shape: KVShape, c: _Counts) -> int:
        return self._sections(None, shape, c)[0].size

    def max_encoded_size(self, shape: KVShape) -> int:
        return self._size(shape, self._counts(shape))

    def section_sizes(self, shape: KVShape, nbytes: int) -> tuple[int, ...]:
        return tuple(self._sections(None, shape, self._counts(shape))[0].sizes)  # in _sections' order

    # ------------------------------------------------------------------ encode
    def _encode(self, k: np.ndarray, v: np.ndarray, shape: KVShape, out: np.ndarray,
                importance: np.ndarray | None = None, first_layer: int = 0) -> int:
        c = self._counts(shape)
        s, sec = self._sections(out, shape, c)
        k, v = kernel_input(k), kernel_input(v)
        T = shape.tokens
        for x, pre in ((k, "k"), (v, "v")):
            if c.s:
                kern.row_encode8(x[:, :, :c.s], sec[pre + "s_q"], sec[pre + "s_s"].view(np.uint16), sec[pre + "s_z"])
            if c.r:
                kern.row_encode8(x[:, :, T - c.r:], sec[pre + "r_q"], sec[pre + "r_s"].view(np.uint16),
                                 sec[pre + "r_z"])
        if c.m:
            ng = sec["ks"].shape[2]
            lo = np.empty((shape.layers, shape.heads, ng, shape.dim), np.float32)
            hi = np.empty_like(lo)
            cs, sn, rope = _rope(c.m, shape.dim, self.k_rope_theta)  # keys as before rotary embedding
            mk.chan_group_range(k, c.s, c.m, self.group, cs, sn, rope, lo, hi)
            bits = allocate_bits(np.square(hi - lo).mean(axis=2) * self._qweights(shape, first_layer), c.kb)
            sec["kbits"][...] = bits
            mk.kbits_encode(k, c.s, c.m, self.group, cs, sn, rope, lo, hi, bits, _offsets(bits, c.m), sec["kq"],
                            sec["ks"].view(np.uint16), sec["kz"].view(np.uint16))
            vcls = np.zeros((shape.layers, c.m), np.uint8)
            if c.nv8 or c.nv2:  # token importance only matters when V tokens get other widths
                if importance is None:
                    imp = np.empty((shape.layers, c.m), np.float32)
                    mk.token_norms(k, c.s, imp)
                else:
                    imp = np.ascontiguousarray(importance[:, c.s:T - c.r])
                order_t: np.ndarray = np.argsort(-imp, axis=-1, kind="stable")
                np.put_along_axis(vcls, order_t[:, :c.nv8], 1, axis=-1)
                if c.nv2:
                    np.put_along_axis(vcls, order_t[:, c.m - c.nv2:], 2, axis=-1)
            sec["vcls"][...] = vcls
            mk.vmid_encode(v, c.s, self.v_rotate, vcls, _slots(vcls), sec["v8"], sec["v8s"].view(np.uint16),
                           sec["v8z"], sec["v4"], sec["v4s"].view(np.uint16), sec["v4z"].view(np.uint16),
                           sec["v2"], sec["v2s"].view(np.uint16), sec["v2z"].view(np.uint16))
        return s.size

    def _qweights(self, shape: KVShape, first_layer: int) -> np.ndarray:
        """E[q_c^2] per (layer, head, channel) of the range's layers, or ones without a fitting table."""
        if self.calib is not None:
            tab = _calib_table(self.calib)
            if tab.shape[1:] == (shape.heads, shape.dim) and first_layer + shape.layers <= tab.shape[0]:
                return tab[first_layer:first_layer + shape.layers]
        return np.ones((shape.layers, shape.heads, shape.dim), np.float32)

    # ------------------------------------------------------------------ decode
    def _decode(self, payload: np.ndarray, shape: KVShape, k_out: np.ndarray, v_out: np.ndarray) -> None:
        c = self._counts(shape)
        _, sec = self._sections(payload, shape, c)
        T = shape.tokens
        if c.m:
            kbits, vcls = np.ascontiguousarray(sec["kbits"]), sec["vcls"]
            if (kbits < K_MIN_BITS).any() or (kbits > K_MAX_BITS).any():
                raise CorruptPayloadError(f"mixed: K bit table holds widths outside {K_MIN_BITS}..{K_MAX_BITS}")
            if (kbits.reshape(shape.layers, -1).sum(-1, dtype=np.int64) != c.kb).any():
                raise CorruptPayloadError("mixed: K bit table does not sum to the params' budget")
            if (vcls > 2).any():
                raise CorruptPayloadError("mixed: class map holds codes other than 0, 1, 2")
            if ((vcls == 1).sum(-1) != c.nv8).any() or ((vcls == 2).sum(-1) != c.nv2).any():
                raise CorruptPayloadError("mixed: V token classes do not match the params")
        for dst, pre in ((k_out, "k"), (v_out, "v")):
            out = KernelOutput(dst)
            x = out.target
            if c.s:
                kern.row_dequant8(sec[pre + "s_q"], sec[pre + "s_s"].astype(np.float32),
                                  -sec[pre + "s_z"].astype(np.float32) * sec[pre + "s_s"].astype(np.float32),
                                  x[:, :, :c.s])
            if c.r:
                kern.row_dequant8(sec[pre + "r_q"], sec[pre + "r_s"].astype(np.float32),
                                  -sec[pre + "r_z"].astype(np.float32) * sec[pre + "r_s"].astype(np.float32),
                                  x[:, :, T - c.r:])
            if c.m and pre == "k":
                cs, sn, rope = _rope(c.m, shape.dim, self.k_rope_theta)
                mk.kbits_decode(sec["kq"], self.group, kbits, _offsets(kbits, c.m), sec["ks"].view(np.uint16),
                                sec["kz"].view(np.uint16), cs, sn, rope, x, c.s, c.m)
            elif c.m:
                vcls = np.ascontiguousarray(sec["vcls"])
                mk.vmid_decode(vcls, _slots(vcls), sec["v8"], sec["v8s"].view(np.uint16), sec["v8z"],
                               sec["v4"], sec["v4s"].view(np.uint16), sec["v4z"].view(np.uint16),
                               sec["v2"], sec["v2s"].view(np.uint16), sec["v2z"].view(np.uint16),
                               self.v_rotate, x, c.s)
            out.finish()


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """Largest n in [lo, hi] with ok(n), for ok true at lo and monotone (true, then false)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """Smallest n in [lo, hi] with ok(n) (hi if none), for ok monotone (false, then true)."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def _slots(cls: np.ndarray) -> np.ndarray:
    """Rank of each token among the tokens of its class, per layer."""
    slot = np.zeros(cls.shape, np.int64)
    for code in (0, 1, 2):
        m = cls == code
        slot[m] = (np.cumsum(m, axis=-1) - 1)[m]
    return slot


_GAIN_STEPS = np.arange(K_MIN_BITS, K_MAX_BITS, dtype=np.float64)
# error factor of one more bit: 1/(2^b - 1)^2 - 1/(2^(b+1) - 1)^2, for b = 2..7
_GAIN = 1.0 / np.square(2.0 ** _GAIN_STEPS - 1) - 1.0 / np.square(2.0 ** (_GAIN_STEPS + 1) - 1)


def allocate_bits(weight: np.ndarray, budget: int) -> np.ndarray:
    """Bits (L, H, D) in 2..8 with ``budget`` bits per layer minimising sum(weight * step^2), where
    ``step = range / (2^bits - 1)`` and ``weight = E[q^2] * E[range^2]``: greedy (optimal here: each
    channel's gain per extra bit falls), i.e. the ``budget - 2HD`` largest marginal gains per layer,
    ties to the lower index (a stable sort's order; found by a partition, which is 10x cheaper)."""
    L, H, D = weight.shape
    gains = (weight.reshape(L, H * D, 1).astype(np.float64) * _GAIN).reshape(L, -1)
    gains[np.isnan(gains)] = -1.0  # after every real gain (>= 0), as a sort puts NaN last
    extra = budget - K_MIN_BITS * H * D
    if extra >= gains.shape[1]:
        take = np.ones(gains.shape, bool)
    elif extra > 0:
        thr = -np.partition(-gains, extra - 1, axis=1)[:, extra - 1:extra]  # the extra-th largest gain
        take = gains > thr
        tie = gains == thr
        take |= tie & (np.cumsum(tie, axis=1) <= extra - take.sum(axis=1, keepdims=True))
    else:
        take = np.zeros(gains.shape, bool)
    bits = K_MIN_BITS + take.reshape(L, H * D, -1).sum(-1, dtype=np.uint8)
    return np.ascontiguousarray(bits.reshape(L, H, D).astype(np.uint8))


def _offsets(bits: np.ndarray, m: int) -> np.ndarray:
    """Byte offset of each (head, channel) stream in its layer's K section: chunks * preceding bits."""
    L = bits.shape[0]
    flat = bits.reshape(L, -1).astype(np.int64)
    off = (np.cumsum(flat, axis=1) - flat) * ((m + 7) // 8)
    return np.ascontiguousarray(off.reshape(bits.shape))


@functools.lru_cache(maxsize=8)
def _rope_table(m: int, dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (m, dim / 2) fp32 of angle ``t * theta^(-2d/dim)`` for middle token t (positions
    relative to the first middle token: a range's absolute offset is one fixed rotation per pair,
    which per-channel quantization does not mind). Read-only: shared between calls."""
    inv = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.arange(m, dtype=np.float64)[:, None] * inv[None]
    cs, sn = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    cs.flags.writeable = False
    sn.flags.writeable = False
    return cs, sn


_NO_ROPE = np.zeros((0, 1), np.float32)
_NO_ROPE.flags.writeable = False  # the same numba type as the tables: one compiled variant


def _rope(m: int, dim: int, theta: float | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """(cos, sin, on) for the K kernels: the tables of :func:`_rope_table`, or empty ones and off."""
    if theta is None:
        return _NO_ROPE, _NO_ROPE, False
    return (*_rope_table(m, dim, theta), True)


_TABLES: dict[str, np.ndarray] = {}


def _calib_table(name: str) -> np.ndarray:
    if name not in _TABLES:
        import base64

        from kvport.codec import _kcalib_smollm2 as t

        raw = base64.b64decode("".join(t.QSQ_F16_B64))
        _TABLES[name] = np.frombuffer(raw, np.float16).astype(np.float32).reshape(t.SHAPE)
    return _TABLES[name]
