"""The codec interface: what every codec encodes, what it promises, and the checks they all share.

A codec works on a *range* of KV: ``k`` and ``v`` of shape ``(layers, heads, tokens, dim)`` (the
canonical LKHTD block split into its K and V halves; ``layers`` may be fewer than the spec's, for
layer-wise streaming) in the spec's dtype (bf16, fp16 or fp32). It writes one flat ``uint8`` payload
whose size is fixed by the :class:`KVShape` and the codec's parameters (``lossless`` alone is
data-dependent and only bounded), and decodes that payload into caller-provided destination arrays
of exactly that shape.

Invariants every codec keeps:

* ``params`` is a small msgpack-able dict; ``get_codec(codec_id, **params)`` rebuilds the same codec,
  so ``(codec_id, params)`` travels in block keys and wire metadata and is all a decoder needs.
* ``decode`` validates the payload size against the shape and params *before* touching the
  destination, and writes nothing but the destination's own elements (payload values never become
  write indexes without a range check).
* Hot paths reuse buffers: ``encode(..., out=buf)`` writes into a caller buffer, ``decode`` into the
  caller's tensors; kernels run on one thread.

Inputs and destinations are numpy arrays or CPU torch tensors. torch is never imported here: a tensor
can only be passed where torch is already imported, so ``sys.modules`` tells (the core runs without it).
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, cast

import numpy as np

from kvport.errors import CodecParamsError
from kvport.spec import DType, KVSpec

if TYPE_CHECKING:
    import torch

ArrayLike: TypeAlias = "torch.Tensor | np.ndarray"

_NP_BITS: dict[DType, np.dtype[Any]] = {
    DType.BF16: np.dtype(np.uint16), DType.FP16: np.dtype(np.float16), DType.FP32: np.dtype(np.float32)}
_TORCH_NAMES = {DType.BF16: "bfloat16", DType.FP16: "float16", DType.FP32: "float32"}


def _torch_tensor(x: object) -> torch.Tensor | None:
    """``x`` if it is a torch tensor (torch already imported by whoever made it), else None."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and isinstance(x, torch_mod.Tensor):
        return cast("torch.Tensor", x)
    return None


@dataclass(frozen=True, slots=True)
class KVShape:
    """Shape of one encoded range: K and V are each ``(layers, heads, tokens, dim)`` of ``dtype``."""

    layers: int
    heads: int
    tokens: int
    dim: int
    dtype: DType

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "tokens", "dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise CodecParamsError(f"{name} must be a positive integer, got {v!r}")
        if self.dtype not in _NP_BITS:
            raise CodecParamsError(f"codecs support bf16, fp16 and fp32 KV, not {self.dtype.value}")

    @classmethod
    def of(cls, spec: KVSpec, tokens: int, layers: int | None = None) -> KVShape:
        if spec.latent:
            raise CodecParamsError("codecs need separate K and V (latent MLA caches are not supported)")
        return cls(spec.num_layers if layers is None else layers, spec.kv_heads_per_rank, tokens,
                   spec.head_dim, spec.dtype)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.layers, self.heads, self.tokens, self.dim)

    @property
    def values(self) -> int:
        """Number of K plus V elements."""
        return 2 * self.layers * self.heads * self.tokens * self.dim

    @property
    def nbytes(self) -> int:
        """Bytes of K plus V in ``dtype`` (the codec's input size)."""
        return self.values * self.dtype.itemsize

    @property
    def bf16_bytes(self) -> int:
        """Bytes of K plus V in bf16: the denominator of every reported size ratio."""
        return self.values * 2

    def as_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "heads": self.heads, "tokens": self.tokens, "dim": self.dim,
                "dtype": self.dtype.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVShape:
        try:
            return cls(int(d["layers"]), int(d["heads"]), int(d["tokens"]), int(d["dim"]), DType.parse(d["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecParamsError(f"invalid KV shape {dict(d)!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded range: the codec that made it, its params, the shape it decodes to, the payload.

    ``payload`` is a 1-D ``uint8`` array (possibly a view into the caller's ``out`` buffer) of exactly
    ``nbytes`` bytes; ``codec_id`` + ``params`` + ``shape`` are everything a decoder needs besides it.
    """

    codec_id: str
    params: Mapping[str, Any]
    shape: KVShape
    payload: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)

    @property
    def ratio(self) -> float:
        """bf16 bytes of the range / encoded bytes (every scale, zero point and index counted)."""
        return self.shape.bf16_bytes / max(1, self.nbytes)


class Codec(abc.ABC):
    """Encode K and V of a range into one payload; decode it into caller tensors."""

    codec_id: ClassVar[str]
    lossless: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def params(self) -> dict[str, Any]:
        """msgpack-able parameters; ``get_codec(self.codec_id, **self.params)`` rebuilds this codec."""

    @abc.abstractmethod
    def max_encoded_size(self, shape: KVShape) -> int:
        """Upper bound of the payload size (exact for every codec but ``lossless``)."""

    @abc.abstractmethod
    def _encode(self, k: np.ndarray, v: np.ndarray, shape: KVShape, out: np.ndarray,
                importance: np.ndarray | None = None, first_layer: int = 0) -> int:
        """Write the payload of (k, v) into ``out`` (>= max_encoded_size bytes); return bytes written."""

    @abc.abstractmethod
    def _decode(self, payload: np.ndarray, shape: KVShape, k_out: np.ndarray, v_out: np.ndarray) -> None:
        """Decode a size-checked payload into the destination arrays (already shape/dtype checked)."""

    def _check_payload(self, payload: np.ndarray, shape: KVShape) -> None:
        """Raise CorruptPayloadError unless ``payload`` has the size this codec writes for ``shape``."""
        from kvport.errors import CorruptPayloadError

        want = self.max_encoded_size(shape)
        if payload.nbytes != want:
            raise CorruptPayloadError(f"{self.codec_id}: payload is {payload.nbytes} bytes, expected {want} "
                                      f"for {shape.dims} {shape.dtype.value}")

    def section_sizes(self, shape: KVShape, nbytes: int) -> tuple[int, ...]:
        """Bytes of each section of a payload of ``nbytes`` for ``shape`` (codes, scales, zero points,
        tables), in payload order, each with its alignment pad, so that they tile the payload. A stored
        frame lists each as a part with its own check. Default: the payload is one section."""
        return (nbytes,)

    # ------------------------------------------------------------------ public API
    def encoded_size(self, shape: KVShape) -> int:
        """Payload bytes for ``shape`` (an upper bound for ``lossless``)."""
        return self.max_encoded_size(shape)

    def encode(self, k: ArrayLike, v: ArrayLike, spec: KVSpec | None = None,
               out: np.ndarray | memoryview | bytearray | None = None,
               importance: ArrayLike | None = None, first_layer: int = 0) -> Encoded:
        """Encode ``k`` and ``v`` (each ``(layers, heads, tokens, dim)``); ``out`` is an optional caller
        buffer of at least :meth:`max_encoded_size` bytes that the payload is written into.

        ``importance`` (``(layers, tokens)`` or ``(tokens,)``, e.g. attention mass supplied by the
        engine) steers codecs that choose tokens (``mixed``); the others ignore it. It changes which
        tokens get more bits, never the payload size. ``first_layer`` is the model layer of the range's
        first layer, for codecs with per-layer calibration tables (``mixed``); it never changes the size
        and the payload decodes without it."""
        ka, kshape = as_kv_array(k, "k")
        va, vshape = as_kv_array(v, "v")
        if kshape != vshape:
            raise CodecParamsError(f"k and v differ: {kshape.dims} {kshape.dtype.value} vs "
                                   f"{vshape.dims} {vshape.dtype.value}")
        if spec is not None:
            check_against_spec(kshape, spec)
        cap = self.max_encoded_size(kshape)
        if out is None:
            buf = np.empty(cap, dtype=np.uint8)
        else:
            buf = np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) else out.view(np.uint8)
            if buf.ndim != 1 or buf.nbytes < cap:
                raise CodecParamsError(f"{self.codec_id}: out buffer holds {buf.nbytes} bytes, needs {cap}")
            if not buf.flags.writeable:
                raise CodecParamsError(f"{self.codec_id}: out buffer is read-only")
        imp = None
        if importance is not None:
            timp = _torch_tensor(importance)
            imp = np.asarray(timp.detach().float().numpy() if timp is not None else importance, dtype=np.float32)
            if imp.ndim == 1:
                imp = np.broadcast_to(imp, (kshape.layers, imp.shape[0]))
            if imp.shape != (kshape.layers, kshape.tokens):
                raise CodecParamsError(f"importance must be (layers, tokens) = {(kshape.layers, kshape.tokens)} "
                                       f"or (tokens,), got {tuple(imp.shape)}")
        if not isinstance(first_layer, int) or first_layer < 0:
            raise CodecParamsError(f"first_layer must be a non-negative int, got {first_layer!r}")
        n = self._encode(ka, va, kshape, buf, imp, first_layer)
        return Encoded(self.codec_id, self.params, kshape, buf[:n])

    def decode(self, enc: Encoded | np.ndarray | bytes | memoryview, k_out: ArrayLike, v_out: ArrayLike,
               shape: KVShape | None = None) -> None:
        """Decode into ``k_out`` / ``v_out`` (caller tensors of the encoded shape and dtype).

        ``enc`` is an :class:`Encoded` or a bare payload with its ``shape``. Raises CorruptPayloadError
        on a payload of the wrong size or content, CodecParamsError on destinations that do not match.
        """
        if isinstance(enc, Encoded):
            if enc.codec_id != self.codec_id or dict(enc.params) != self.params:
                raise CodecParamsError(f"payload was encoded by {enc.codec_id} {dict(enc.params)}, "
                                       f"not {self.codec_id} {self.params}")
            payload, shp = enc.payload, enc.shape
        else:
            if shape is None:
                raise CodecParamsError("a bare payload needs its shape")
            payload = enc if isinstance(enc, np.ndarray) else np.frombuffer(enc, dtype=np.uint8)
            payload, shp = payload.view(np.uint8).reshape(-1), shape
        ko, kshape = as_kv_array(k_out, "k_out", writable=True)
        vo, vshape = as_kv_array(v_out, "v_out", writable=True)
        for name, got in (("k_out", kshape), ("v_out", vshape)):
            if got != shp:
                raise CodecParamsError(f"{name} is {got.dims} {got.dtype.value}, payload decodes to "
                                       f"{shp.dims} {shp.dtype.value}")
        self._check_payload(payload, shp)
        self._decode(payload, shp, ko, vo)


def as_kv_array(x: ArrayLike, name: str, writable: bool = False) -> tuple[np.ndarray, KVShape]:
    """A zero-copy numpy view of a 4-D KV tensor (bf16 as its uint16 bit pattern) and its shape."""
    tensor = _torch_tensor(x)
    if tensor is not None:
        import torch  # already imported: x is one of its tensors

        if tensor.device.type != "cpu":
            raise CodecParamsError(f"{name} must be a CPU tensor, got {tensor.device}")
        dt = next((d for d, n in _TORCH_NAMES.items() if getattr(torch, n) == tensor.dtype), None)
        if dt is None:
            raise CodecParamsError(f"{name}: unsupported dtype {tensor.dtype}")
        arr = (tensor.view(torch.int16).numpy().view(np.uint16) if dt is DType.BF16 else tensor.numpy())
    elif isinstance(x, np.ndarray):
        arr = x
        dt = next((d for d, t in _NP_BITS.items() if t == x.dtype), None)
        if dt is None:
            raise CodecParamsError(f"{name}: unsupported dtype {x.dtype} (bf16 travels as uint16)")
    else:
        raise CodecParamsError(f"{name} must be a torch tensor or numpy array, got {type(x).__name__}")
    if arr.ndim != 4:
        raise CodecParamsError(f"{name} must be 4-D (layers, heads, tokens, dim), got shape {tuple(arr.shape)}")
    if writable and not arr.flags.writeable:
        raise CodecParamsError(f"{name} is read-only")
    if arr.strides[-1] != arr.itemsize:
        raise CodecParamsError(f"{name}: the dim axis must be contiguous")
    nl, nh, nt, nd = (int(s) for s in arr.shape)
    return arr, KVShape(nl, nh, nt, nd, dt)


def check_against_spec(shape: KVShape, spec: KVSpec) -> None:
    if spec.latent:
        raise CodecParamsError("codecs need separate K and V (latent MLA caches are not supported)")
    want = (spec.kv_heads_per_rank, spec.head_dim, spec.dtype)
    got = (shape.heads, shape.dim, shape.dtype)
    if got != want or shape.layers > spec.num_layers:
        raise CodecParamsError(f"KV of shape {shape.dims} {shape.dtype.value} does not match the spec "
                               f"({spec.num_layers} layers, {spec.kv_heads_per_rank} heads, dim {spec.head_dim}, "
                               f"{spec.dtype.value})")


def torch_dtype(dt: DType) -> torch.dtype:
    """The torch dtype of ``dt`` (for callers that use torch: imports it)."""
    import torch

    dtype: torch.dtype = getattr(torch, _TORCH_NAMES[dt])
    return dtype


def np_dtype(dt: DType) -> np.dtype[Any]:
    """The numpy dtype a KV array of ``dt`` is viewed as (bf16 -> uint16 bit pattern)."""
    return _NP_BITS[dt]
