"""``mixed``: mixed precision by importance, with a target size ratio as the knob.

Tokens of a range of T: ``sinks`` first tokens and ``recent`` last tokens keep K and V at 8 bits
(per (layer, head, token) rows, as ``int8``); the M middle tokens are split by component:

* K, per channel over groups of ``group`` tokens (KIVI), with bits allocated across *channels*:
  per (layer, head) the ``k_hi`` channels of widest range get 8 bits, the ``k_lo`` narrowest 2,
  the rest 4 (the class of each channel is stored, so decoding needs nothing else);
* V, per (layer, head, token) row, with bits allocated across *tokens*: per layer the ``v_top``
  share of middle tokens with the largest key norm (or engine-supplied importance, e.g. attention
  mass) get 8 bits, the ``v_low`` share with the smallest 2, the rest 4. ``target_ratio`` (when
  set) replaces ``v_top``: the largest 8-bit share whose ratio still meets the target; when the
  fixed parts alone miss it, more of the least important V tokens drop to 2 bits instead.

Payload (sections 8-byte aligned; S, R, M as clipped to T; n8/n4/n2 channels, nv8/nv4/nv2 tokens)::

    hi rows  K sinks, K recent, V sinks, V recent: codes u8 [L,H,n,D], scale f16 [L,H,n], zp u8 [L,H,n]
    kcls     u8  [L, H, D]                 class of each K channel (1: 8 bits, 0: 4, 2: 2)
    kq8      u8  [L, H, M, n8]             kq4 u8 [L, H, ceil(M/2), n4]    kq2 u8 [L, H, ceil(M/4), n2]
    ks, kz   f16 [L, H, ceil(M/group), D]
    vcls     u8  [L, M]                    class of each middle token's V
    v8       u8 [L,H,nv8,D] + f16 scale + u8 zp;  v4 u8 [L,H,nv4,D/2] + f16 scale, zero;  v2 likewise D/4

Every byte above counts in the ratio. Decoding checks that the class maps hold exactly the counts
the params imply before any kernel runs, so slots and channel indexes stay inside their sections.
"""

from __future__ import annotations

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

_CLASS_RANK = np.array([1, 0, 2], dtype=np.int8)  # sort key: class 1 (8 bits) first, then 0, then 2


@dataclass(frozen=True, slots=True)
class _Counts:
    s: int
    r: int
    m: int
    n8: int
    n4: int
    n2: int
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

    def __init__(self, group: int = 64, sinks: int = 4, recent: int = 32, k_hi: int = 8, k_lo: int = 8,
                 v_top: float = 0.1, v_low: float = 0.0, target_ratio: float | None = 3.5,
                 **params: Any) -> None:
        if params:
            raise CodecParamsError(f"mixed: unknown params {sorted(params)}")
        self.group = _int("group", group, 4, 1 << 16)
        if self.group % 4:
            raise CodecParamsError(f"mixed: group must be a multiple of 4, got {group}")
        self.sinks = _int("sinks", sinks, 0, 1 << 16)
        self.recent = _int("recent", recent, 0, 1 << 16)
        self.k_hi = _int("k_hi", k_hi, 0, 4096)
        self.k_lo = _int("k_lo", k_lo, 0, 4096)
        self.v_top = _share("v_top", v_top)
        self.v_low = _share("v_low", v_low)
        if self.v_top + self.v_low > 1.0:
            raise CodecParamsError("mixed: v_top + v_low must not exceed 1")
        if target_ratio is not None and (not isinstance(target_ratio, int | float) or isinstance(target_ratio, bool)
                                         or not 1.0 <= float(target_ratio) <= 16.0):
            raise CodecParamsError(f"mixed: target_ratio must be a number in [1, 16] or None, got {target_ratio!r}")
        self.target_ratio = None if target_ratio is None else float(target_ratio)

    @property
    def params(self) -> dict[str, Any]:
        return {"group": self.group, "sinks": self.sinks, "recent": self.recent, "k_hi": self.k_hi,
                "k_lo": self.k_lo, "v_top": self.v_top, "v_low": self.v_low, "target_ratio": self.target_ratio}

    # ------------------------------------------------------------------ sizes
    def _counts(self, shape: KVShape, nv8: int | None = None, nv2: int | None = None) -> _Counts:
        T, D = shape.tokens, shape.dim
        if D % 4:
            raise CodecParamsError(f"mixed needs head_dim divisible by 4, got {D}")
        if self.k_hi + self.k_lo > D:
            raise CodecParamsError(f"mixed: k_hi + k_lo = {self.k_hi + self.k_lo} exceeds head_dim {D}")
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
        return _Counts(s, r, m, self.k_hi, D - self.k_hi - self.k_lo, self.k_lo, nv8, m - nv8 - nv2, nv2)

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
        sec["kcls"] = s.take(np.uint8, (L, H, D))
        sec["kq8"] = s.take(np.uint8, (L, H, c.m, c.n8))
        sec["kq4"] = s.take(np.uint8, (L, H, (c.m + 1) // 2, c.n4))
        sec["kq2"] = s.take(np.uint8, (L, H, (c.m + 3) // 4, c.n2))
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

    # ------------------------------------------------------------------ encode
    def _encode(self, k: np.ndarray, v: np.ndarray, shape: KVShape, out: np.ndarray,
                importance: np.ndarray | None = None) -> int:
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
            kmid, vmid = k[:, :, c.s:T - c.r], v[:, :, c.s:T - c.r]
            ranges = np.empty(sec["kcls"].shape, np.float32)
            mk.chan_range(kmid, ranges)
            order: np.ndarray = np.argsort(-ranges, axis=-1, kind="stable")
            kcls = np.zeros(ranges.shape, np.uint8)
            np.put_along_axis(kcls, order[..., :c.n8], 1, axis=-1)
            if c.n2:
                np.put_along_axis(kcls, order[..., shape.dim - c.n2:], 2, axis=-1)
            sec["kcls"][...] = kcls
            mk.kmid_encode(kmid, self.group, _perm(kcls), c.n8, c.n4, sec["kq8"], sec["kq4"], sec["kq2"],
                           sec["ks"].view(np.uint16), sec["kz"].view(np.uint16))
            if importance is None:
                imp = np.empty((shape.layers, c.m), np.float32)
                mk.token_norms(kmid, imp)
            else:
                imp = np.ascontiguousarray(importance[:, c.s:T - c.r])
            vcls = np.zeros((shape.layers, c.m), np.uint8)
            if c.nv8 or c.nv2:
                order_t: np.ndarray = np.argsort(-imp, axis=-1, kind="stable")
                np.put_along_axis(vcls, order_t[:, :c.nv8], 1, axis=-1)
                if c.nv2:
                    np.put_along_axis(vcls, order_t[:, c.m - c.nv2:], 2, axis=-1)
            sec["vcls"][...] = vcls
            mk.vmid_encode(vmid, vcls, _slots(vcls), sec["v8"], sec["v8s"].view(np.uint16), sec["v8z"],
                           sec["v4"], sec["v4s"].view(np.uint16), sec["v4z"].view(np.uint16),
                           sec["v2"], sec["v2s"].view(np.uint16), sec["v2z"].view(np.uint16))
        return s.size

    # ------------------------------------------------------------------ decode
    def _decode(self, payload: np.ndarray, shape: KVShape, k_out: np.ndarray, v_out: np.ndarray) -> None:
        c = self._counts(shape)
        _, sec = self._sections(payload, shape, c)
        T = shape.tokens
        if c.m:
            kcls, vcls = sec["kcls"], sec["vcls"]
            if (kcls > 2).any() or (vcls > 2).any():
                raise CorruptPayloadError("mixed: class map holds codes other than 0, 1, 2")
            if ((kcls == 1).sum(-1) != c.n8).any() or ((kcls == 2).sum(-1) != c.n2).any():
                raise CorruptPayloadError("mixed: K channel classes do not match the params")
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
                mk.kmid_decode(sec["kq8"], sec["kq4"], sec["kq2"], self.group, _perm(sec["kcls"]), c.n8, c.n4,
                               sec["ks"].view(np.uint16), sec["kz"].view(np.uint16), x[:, :, c.s:T - c.r])
            elif c.m:
                vcls = np.ascontiguousarray(sec["vcls"])
                mk.vmid_decode(vcls, _slots(vcls), sec["v8"], sec["v8s"].view(np.uint16), sec["v8z"],
                               sec["v4"], sec["v4s"].view(np.uint16), sec["v4z"].view(np.uint16),
                               sec["v2"], sec["v2s"].view(np.uint16), sec["v2z"].view(np.uint16),
                               x[:, :, c.s:T - c.r])
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


def _perm(kcls: np.ndarray) -> np.ndarray:
    """Channel order per (layer, head): class 1, then 0, then 2, each ascending."""
    return np.argsort(_CLASS_RANK[kcls], axis=-1, kind="stable").astype(np.int64)


def _slots(cls: np.ndarray) -> np.ndarray:
    """Rank of each token among the tokens of its class, per layer."""
    slot = np.zeros(cls.shape, np.int64)
    for code in (0, 1, 2):
        m = cls == code
        slot[m] = (np.cumsum(m, axis=-1) - 1)[m]
    return slot
