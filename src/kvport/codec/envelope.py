"""Block envelope: every stored block says what it is, lists its parts, and checks each part.

One store value (one block under one key) is a header, a manifest of its parts, and the parts back
to back (little-endian)::

    off size field                                      off size field
    0   4    magic b"KVBE"                              20  2    tp_size
    4   1    version (1)                                22  2    tp_rank
    5   1    body: 0 layout bytes, 1 codec frame        24  2    head_lo  \\ the model's KV heads
    6   1    layout (1 lkhtd, 2 vllm_cpu)               26  2    head_hi  /  [lo, hi) held by tp_rank
    7   1    dtype (1 bf16, 2 fp16, 3 fp32, 4 fp8)      28  4    header_len H
    8   1    flags (1: latent)                          32  8    payload_len P
    9   1    reserved (0)                               40  16   spec fingerprint (KVSpec.fingerprint)
    10  2    n_parts N                                  56  16   block key (the store key it was written under)
    12  2    layers                                     72  24N  manifest: one entry per part
    14  2    head_dim                                   ..       zeros up to H - 8
    16  4    tokens                                     H-8 8    xxh3_64 of bytes [0, H - 8)
                                                        H   P    the parts, back to back

    H = 80 + 24 N rounded up to a multiple of 64 (the parts start cache-line aligned)

    manifest entry (24 B):  kind u8 | sub u8 | layer u16 | head_lo u16 | head_hi u16 |
                            offset u32 | length u32 | xxh3_64 of the part's bytes u64

| kind | part | layer | sub |
|---|---|---|---|
| 1 K, 2 V | one layer's keys / values ``[heads, tokens, dim]`` (lkhtd) | the layer | 0 |
| 3 KV | a layer's slab: per head K then V rows (vllm_cpu); K, V ``[tokens, heads, dim]`` (vllm_nhd) | the layer | 0 |
| 4 LATENT | one layer's latent ``[tokens, dim]`` (MLA) | the layer | 0 |
| 16 META | codec id and params, msgpack ``{"id", "params"}`` | 0xFFFF | 0 |
| 17 SECTION | a codec payload section (codes, scales, zero points, bit tables) | 0xFFFF | its index |
| 32 EXTRA | a model's extra buffer | a layer or 0xFFFF | the buffer's id |

Parts tile the payload: the first at offset 0, each where the one before ends, the last at P.

Reading checks, before a byte of the payload is used: the value's length, magic, version, every
count and length against caps and against the value itself, the header digest, the identity (spec
fingerprint, layout, dtype, shape, tp_size, tp_rank, head range) and the key against the reader's,
the manifest against the parts the reader expects (none missing, none extra, each where it should
be), and each part's xxh3_64. Any failure is a :class:`~kvport.errors.CodecError`
(``CorruptPayloadError``: missing envelope, damage, a part missing, truncated or failing its check;
``CodecParamsError``: a block of another spec, layout, rank, head range or key), which every
loader treats as a miss: the tokens are recomputed, nothing is linked.

Part digests are computed where the parts are written, while their bytes are in cache
(:meth:`BlockFormat.seal` right after a block was copied into its page), and checked with one
native call per block (:func:`kvport.memops.xxh3_many`, the GIL released).
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import xxhash

from kvport import memops
from kvport.errors import CodecError, CodecParamsError, CorruptPayloadError
from kvport.spec import DType, KVSpec, Layout

MAGIC = b"KVBE"
VERSION = 1
KEY_BYTES = 16
ALL_LAYERS = 0xFFFF
MAX_PARTS = 16384  # header of at most ~393 KiB
MAX_PAYLOAD = 1 << 31
_FIXED = struct.Struct("<4sBBBBBBHHHIHHHHIQ16s16s")
FIXED_BYTES = _FIXED.size  # 72
_ENTRY = np.dtype([("kind", "u1"), ("sub", "u1"), ("layer", "<u2"), ("head_lo", "<u2"), ("head_hi", "<u2"),
                   ("offset", "<u4"), ("length", "<u4"), ("digest", "<u8")])
ENTRY_BYTES = _ENTRY.itemsize  # 24
_KEY_AT = 56
_LAYOUTS = {Layout.LKHTD: 1, Layout.VLLM_CPU: 2, Layout.HF: 3, Layout.VLLM_NHD: 4}
_LAYOUT_OF = {v: k for k, v in _LAYOUTS.items()}
_DTYPES = {DType.BF16: 1, DType.FP16: 2, DType.FP32: 3, DType.FP8: 4}
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}
_LATENT = 1


class Body(enum.IntEnum):
    LAYOUT = 0  # the parts are the layout's own bytes (a raw block)
    CODEC = 1  # a META part, then the codec payload's sections


class PartKind(enum.IntEnum):
    K = 1
    V = 2
    KV = 3
    LATENT = 4
    META = 16
    SECTION = 17
    EXTRA = 32


_KINDS = frozenset(int(k) for k in PartKind)


def header_bytes(n_parts: int) -> int:
    """H for ``n_parts`` parts: fixed header, manifest, digest, rounded up to 64 bytes."""
    return (FIXED_BYTES + ENTRY_BYTES * n_parts + 8 + 63) & ~63


@dataclass(frozen=True, slots=True)
class Identity:
    """What makes a stored block interchangeable with the reader's KV: the layout fingerprint."""

    layout: Layout
    tp_size: int
    tp_rank: int
    head_lo: int
    head_hi: int
    dtype: DType
    latent: bool
    layers: int
    tokens: int
    head_dim: int
    fingerprint: bytes  # last: the fields above name the difference when there is one

    @classmethod
    def of(cls, spec: KVSpec, *, tokens: int | None = None, layers: int | None = None) -> Identity:
        lo, hi = spec.head_range
        return cls(spec.layout, spec.tp_size, spec.tp_rank, lo, hi, spec.dtype, spec.latent,
                   spec.num_layers if layers is None else layers, spec.block_size if tokens is None else tokens,
                   spec.head_dim, spec.fingerprint)

    def first_mismatch(self, other: Identity) -> tuple[str, Any, Any] | None:
        """The first field (in declaration order) where ``other`` differs, or None."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                if isinstance(mine, bytes) and isinstance(theirs, bytes):
                    return f.name, mine.hex(), theirs.hex()
                return f.name, mine, theirs
        return None


@dataclass(frozen=True, slots=True)
class Part:
    kind: PartKind
    layer: int
    offset: int  # from the start of the payload
    length: int
    sub: int = 0

    def describe(self) -> str:
        where = "" if self.layer == ALL_LAYERS else f" of layer {self.layer}"
        sub = f" {self.sub}" if self.kind in (PartKind.SECTION, PartKind.EXTRA) else ""
        return f"{self.kind.name}{sub}{where}"


@dataclass(frozen=True, slots=True)
class Envelope:
    """A parsed, size-checked header (identity, key, parts); the parts themselves not yet verified."""

    identity: Identity
    key: bytes
    body: Body
    parts: tuple[Part, ...]
    digests: np.ndarray  # u64, one per part
    header_len: int
    payload_len: int

    @property
    def value_len(self) -> int:
        return self.header_len + self.payload_len


def tile(kinds: Sequence[tuple[PartKind, int, int, int]]) -> tuple[Part, ...]:
    """Parts of ``(kind, layer, sub, length)`` laid back to back from offset 0."""
    out, at = [], 0
    for kind, layer, sub, length in kinds:
        out.append(Part(kind, layer, at, length, sub))
        at += length
    return tuple(out)


def write_header(dst: memoryview, ident: Identity, key: bytes, body: Body, parts: Sequence[Part],
                 digests: Any) -> int:
    """Write the header of a value whose payload is ``parts`` into ``dst[:H]``; returns H.
    ``digests``: one u64 per part (anything ``np.frombuffer`` / ``np.asarray`` takes)."""
    if len(key) != KEY_BYTES:
        raise CodecParamsError(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
    n = len(parts)
    if n > MAX_PARTS:
        raise CodecParamsError(f"{n} parts exceed the cap of {MAX_PARTS}")
    h = header_bytes(n)
    plen = parts[-1].offset + parts[-1].length if parts else 0
    if dst.nbytes < h:
        raise CodecParamsError(f"a header of {h} bytes does not fit {dst.nbytes}")
    buf = bytearray(h)
    try:
        _FIXED.pack_into(buf, 0, MAGIC, VERSION, int(body), _LAYOUTS[ident.layout], _DTYPES[ident.dtype],
                         _LATENT if ident.latent else 0, 0, n, ident.layers, ident.head_dim, ident.tokens,
                         ident.tp_size, ident.tp_rank, ident.head_lo, ident.head_hi, h, plen, ident.fingerprint,
                         key)
    except struct.error as exc:  # a field past its width (e.g. > 65535 layers)
        raise CodecParamsError(f"block envelope cannot hold {ident}: {exc}") from exc
    man = np.frombuffer(buf, _ENTRY, count=n, offset=FIXED_BYTES)
    man["kind"] = [int(p.kind) for p in parts]
    man["sub"] = [p.sub for p in parts]
    man["layer"] = [p.layer for p in parts]
    man["head_lo"], man["head_hi"] = ident.head_lo, ident.head_hi
    man["offset"] = [p.offset for p in parts]
    man["length"] = [p.length for p in parts]
    man["digest"] = np.frombuffer(digests, "<u8") if isinstance(digests, bytes | bytearray | memoryview) else digests
    struct.pack_into("<Q", buf, h - 8, xxhash.xxh3_64_intdigest(memoryview(buf)[: h - 8]))
    dst[:h] = buf
    return h


def as_bytes(value: Any) -> memoryview:
    """A flat byte view of ``value`` (bytes, bytearray, memoryview, numpy array); CorruptPayloadError if not
    a contiguous buffer."""
    try:
        mv = memoryview(value)
        if not mv.c_contiguous:
            raise ValueError("not contiguous")
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except (TypeError, ValueError) as exc:
        raise CorruptPayloadError(f"a stored block must be a contiguous buffer: {exc}") from exc


def parse(value: Any) -> Envelope:
    """Parse and check a value's header (caps, lengths, header digest, manifest tiling); not its parts."""
    mv = as_bytes(value)
    if mv.nbytes < FIXED_BYTES or mv[:4] != MAGIC:
        raise CorruptPayloadError("no block envelope (a block written by an older kvport, or not a block)")
    (_, ver, body, lay, dt, flags, _, n, layers, dim, tokens, tp_size, tp_rank, lo, hi, h, plen, fp,
     key) = _FIXED.unpack_from(mv, 0)
    if ver != VERSION:
        raise CorruptPayloadError(f"unknown block envelope version {ver}")
    if n > MAX_PARTS or h != header_bytes(n) or plen > MAX_PAYLOAD:
        raise CorruptPayloadError(f"bad envelope counts ({n} parts, header {h}, payload {plen})")
    if h + plen != mv.nbytes:
        raise CorruptPayloadError(f"block is {mv.nbytes} bytes, its envelope says {h} + {plen} (truncated?)")
    if struct.unpack_from("<Q", mv, h - 8)[0] != xxhash.xxh3_64_intdigest(mv[: h - 8]):
        raise CorruptPayloadError("block envelope header fails its check")
    if body not in (0, 1) or lay not in _LAYOUT_OF or dt not in _DTYPE_OF or flags & ~_LATENT:
        raise CorruptPayloadError(f"bad envelope fields (body {body}, layout {lay}, dtype {dt}, flags {flags})")
    if 0 in (layers, dim, tokens, tp_size) or tp_rank >= tp_size or not lo < hi:
        raise CorruptPayloadError(f"bad envelope shape ({layers} layers, dim {dim}, {tokens} tokens, "
                                  f"rank {tp_rank}/{tp_size}, heads [{lo}, {hi}))")
    man = np.frombuffer(mv, _ENTRY, count=n, offset=FIXED_BYTES)
    ends = man["offset"].astype(np.int64) + man["length"]
    starts_ok = n == 0 or (int(man["offset"][0]) == 0 and bool(np.all(man["offset"][1:] == ends[:-1])))
    if not starts_ok or (int(ends[-1]) if n else 0) != plen:
        raise CorruptPayloadError("envelope parts do not tile the payload (a part missing or mis-placed)")
    if not set(np.unique(man["kind"]).tolist()) <= _KINDS:
        raise CorruptPayloadError(f"unknown part kind in {sorted(set(man['kind'].tolist()))}")
    bad_layer = (man["layer"] >= layers) & (man["layer"] != ALL_LAYERS)
    if bool(np.any(bad_layer)) or bool(np.any((man["head_lo"] != lo) | (man["head_hi"] != hi))):
        raise CorruptPayloadError("envelope part outside the block's layers or head range")
    kinds, subs = man["kind"], man["sub"]
    whole = (kinds == int(PartKind.META)) | (kinds == int(PartKind.SECTION))
    numbered = (kinds == int(PartKind.SECTION)) | (kinds == int(PartKind.EXTRA))
    sections = subs[kinds == int(PartKind.SECTION)]
    if bool(np.any(man["layer"][whole] != ALL_LAYERS)) or bool(np.any(subs[~numbered] != 0)) \
            or not np.array_equal(sections, np.arange(sections.size)):
        raise CorruptPayloadError("envelope part with a layer or index its kind does not have")
    ident = Identity(_LAYOUT_OF[lay], tp_size, tp_rank, lo, hi, _DTYPE_OF[dt], bool(flags & _LATENT), layers,
                     tokens, dim, bytes(fp))
    parts = tuple(Part(PartKind(int(e["kind"])), int(e["layer"]), int(e["offset"]), int(e["length"]), int(e["sub"]))
                  for e in man)
    return Envelope(ident, bytes(key), Body(body), parts, man["digest"].copy(), h, plen)


def check_identity(env: Envelope, want: Identity, key: bytes | None) -> None:
    """CodecParamsError naming the first field where the stored block is not the reader's."""
    diff = want.first_mismatch(env.identity)
    if diff is not None:
        name, mine, theirs = diff
        raise CodecParamsError(f"stored block is of another {name}: {theirs!r}, expected {mine!r}")
    if key is not None and env.key != key:
        raise CodecParamsError(f"stored block was written under key {env.key.hex()}, read as {key.hex()}")


def verify_parts(payload: memoryview, parts: Sequence[Part], digests: np.ndarray) -> None:
    """CorruptPayloadError naming the first part whose bytes fail their xxh3_64."""
    got = np.frombuffer(memops.xxh3_many([payload[p.offset : p.offset + p.length] for p in parts]), "<u8")
    bad = np.flatnonzero(got != digests)
    if bad.size:
        raise CorruptPayloadError(f"part {parts[int(bad[0])].describe()} fails its check "
                                  f"({bad.size} of {len(parts)} parts bad)")


def layout_parts(spec: KVSpec, extras: Sequence[tuple[int, int]] = ()) -> tuple[Part, ...]:
    """The parts of one raw block of ``spec`` in its layout, then ``extras`` ``(id, bytes)``."""
    L, per = spec.num_layers, spec.bytes_per_layer_block
    kinds: list[tuple[PartKind, int, int, int]]
    if spec.latent:
        kinds = [(PartKind.LATENT, layer, 0, per) for layer in range(L)]
    elif spec.layout is Layout.LKHTD:
        kinds = [(kind, layer, 0, per // 2) for layer in range(L) for kind in (PartKind.K, PartKind.V)]
    elif spec.layout in (Layout.VLLM_CPU, Layout.VLLM_NHD):
        kinds = [(PartKind.KV, layer, 0, per) for layer in range(L)]
    else:
        raise CodecParamsError(f"layout {spec.layout.value} has no stored block format")
    for ident, nbytes in extras:
        if not 0 <= ident < 256 or nbytes <= 0:
            raise CodecParamsError(f"extra buffer ({ident}, {nbytes}): id 0..255, a positive size")
        kinds.append((PartKind.EXTRA, ALL_LAYERS, ident, nbytes))
    return tile(kinds)


class BlockFormat:
    """The envelope of one spec's raw blocks: a precomputed header and part table.

    ``seal(value, key)`` writes the header of a value whose payload (``value[header_len:]``) was just
    filled; ``open(value, key)`` checks everything and returns the payload view. The block is
    ``spec.bytes_per_block`` bytes in the spec's layout (lkhtd or vllm_cpu), then any ``extras``.
    """

    def __init__(self, spec: KVSpec, extras: Sequence[tuple[int, int]] = ()) -> None:
        self.spec = spec
        self.identity = Identity.of(spec)
        self.parts = layout_parts(spec, extras)
        self.header_len = header_bytes(len(self.parts))
        self.payload_len = self.parts[-1].offset + self.parts[-1].length
        self.value_bytes = self.header_len + self.payload_len
        self._spans = [(p.offset, p.offset + p.length) for p in self.parts]
        tpl = bytearray(self.header_len)
        write_header(memoryview(tpl), self.identity, bytes(KEY_BYTES), Body.LAYOUT, self.parts,
                     np.zeros(len(self.parts), np.uint64))
        self._template = bytes(tpl)
        self._fixed = self._template[:_KEY_AT]
        man = np.frombuffer(self._template, np.uint64, count=3 * len(self.parts), offset=FIXED_BYTES)
        self._geometry = man.reshape(-1, 3)[:, :2].copy()  # every manifest field but the digest

    def payload(self, value: Any) -> memoryview:
        """``value[header_len:]``, unchecked (where a writer fills the block before :meth:`seal`)."""
        return as_bytes(value)[self.header_len : self.value_bytes]

    def seal(self, value: Any, key: bytes) -> None:
        """Hash each part of the filled payload and write the header in front of it."""
        mv = as_bytes(value)
        if mv.nbytes != self.value_bytes or mv.readonly:
            raise CodecParamsError(f"a block value is a writable {self.value_bytes}-byte buffer, got {mv.nbytes}")
        payload = mv[self.header_len :]
        digests = memops.xxh3_many([payload[a:b] for a, b in self._spans])
        write_header(mv, self.identity, key, Body.LAYOUT, self.parts, digests)

    def open(self, value: Any, key: bytes) -> memoryview:
        """The checked payload of ``value`` stored under ``key`` (a view into ``value``).

        Fast path: the header equals this format's (key and digests aside), one native hash call
        checks every part. Anything else is parsed in full to say exactly what is wrong."""
        mv = as_bytes(value)
        n, h = len(self.parts), self.header_len
        if mv.nbytes != self.value_bytes or mv[:_KEY_AT] != self._fixed or mv[_KEY_AT : _KEY_AT + KEY_BYTES] != key:
            raise self._refusal(mv, key)
        man = np.frombuffer(mv, np.uint64, count=3 * n, offset=FIXED_BYTES).reshape(n, 3)
        if not np.array_equal(man[:, :2], self._geometry) or \
                struct.unpack_from("<Q", mv, h - 8)[0] != xxhash.xxh3_64_intdigest(mv[: h - 8]):
            raise self._refusal(mv, key)
        payload = mv[h:]
        got = np.frombuffer(memops.xxh3_many([payload[a:b] for a, b in self._spans]), "<u8")
        bad = np.flatnonzero(got != man[:, 2])
        if bad.size:
            raise CorruptPayloadError(f"part {self.parts[int(bad[0])].describe()} fails its check "
                                      f"({bad.size} of {n} parts bad)")
        return payload

    def _refusal(self, mv: memoryview, key: bytes) -> CodecError:
        """Why ``mv`` is not a block of this format (the slow path: a full parse)."""
        try:
            env = parse(mv)
            check_identity(env, self.identity, key)
        except CodecError as exc:
            return exc
        if env.body is not Body.LAYOUT:
            return CorruptPayloadError("stored block is a codec frame, expected raw layout bytes")
        for want, got in zip(self.parts, env.parts, strict=False):
            if want != got:
                return CorruptPayloadError(f"part {want.describe()} is missing or mis-placed "
                                           f"(found {got.describe()} at {got.offset}+{got.length})")
        if len(env.parts) != len(self.parts):
            return CorruptPayloadError(f"block has {len(env.parts)} parts, expected {len(self.parts)}")
        return CorruptPayloadError("block envelope does not match its format")


@functools.lru_cache(maxsize=64)
def block_format(spec: KVSpec) -> BlockFormat:
    """The (shared, immutable) format of ``spec``'s raw blocks, without extras."""
    return BlockFormat(spec)


def stored_bytes(spec: KVSpec) -> int:
    """Bytes of one stored raw block of ``spec``: header + ``spec.bytes_per_block`` (a host page must
    hold it: ``StoreConfig(block_bytes=stored_bytes(spec))``)."""
    return block_format(spec).value_bytes
