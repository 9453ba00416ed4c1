"""Codec per link: block-layers travel encoded, one fixed-size chunk each.

A :class:`~kvport.transfer.Sender` built with ``codec=`` announces it in TRANSFER_BEGIN (``codec``
id and params, ``chunk_bytes`` = the encoded size of one block-layer) and encodes every block-layer
before it goes out; a :class:`~kvport.transfer.Receiver` accepts the codecs listed in its
``codecs`` and decodes each chunk straight into the destination view, after the chunk passed its
checksum (a chunk that fails to decode fails the transfer like a checksum would: nothing partial is
linked). Layer-wise streaming, credits (counted in wire bytes) and the ledger are unchanged.

One block-layer is ``(1 layer, 2, heads, block_size, dim)``: what a layer frame carries per block.
Only codecs with an exact encoded size qualify (every codec but ``lossless``, whose size depends on
the data): chunk boundaries on the wire are fixed. Codecs built for long ranges lose ratio on
16-token blocks (``kivi4`` groups K over tokens, ``mixed`` keeps sink tokens at 8 bits); ``int8``
is per token and keeps its 1.9x.
"""

from __future__ import annotations

import numpy as np

from kvport.codec import Codec, get_codec
from kvport.codec.base import KVShape
from kvport.errors import CodecError, CodecParamsError, IncompatibleSpecError
from kvport.protocol.transport import Buffer
from kvport.spec import KVSpec

_NP = {"bf16": np.uint16, "fp16": np.float16, "fp32": np.float32}
_VARIABLE_SIZE = frozenset({"lossless"})


class LinkCodec:
    """Encode / decode one block-layer of ``spec`` with ``codec``."""

    def __init__(self, codec: Codec, spec: KVSpec) -> None:
        if codec.codec_id in _VARIABLE_SIZE:
            raise CodecParamsError(f"{codec.codec_id} has no fixed encoded size: it cannot frame a link's chunks")
        dt = _NP.get(spec.dtype.value)
        if dt is None:
            raise CodecParamsError(f"codecs support bf16, fp16 and fp32 KV, not {spec.dtype.value}")
        self.codec, self.spec = codec, spec
        self.shape = KVShape(1, spec.kv_heads_per_rank, spec.block_size, spec.head_dim, spec.dtype)
        self.np_dtype = dt
        self.raw_bytes = spec.bytes_per_layer_block
        self.chunk_bytes = codec.encoded_size(self.shape)

    @classmethod
    def for_peer(cls, codec_id: str, params: dict[str, object], spec: KVSpec, chunk_bytes: int) -> LinkCodec:
        """The receiver's side, from a peer's TRANSFER_BEGIN: any codec problem is a refusal."""
        try:
            link = cls(get_codec(codec_id, **params), spec)
        except CodecError as exc:
            raise IncompatibleSpecError("codec", "a codec the receiver can build", f"{codec_id} {params}") from exc
        if link.chunk_bytes != chunk_bytes:
            raise IncompatibleSpecError("chunk_bytes", link.chunk_bytes, chunk_bytes)
        return link

    def _kv(self, raw: Buffer, writable: bool) -> np.ndarray:
        a = np.frombuffer(raw, np.uint8)
        if a.nbytes != self.raw_bytes:
            raise CodecParamsError(f"block-layer of {a.nbytes} bytes, expected {self.raw_bytes}")
        s = self.shape
        return a.view(self.np_dtype).reshape(1, 2, s.heads, s.tokens, s.dim)

    def encode_into(self, raw: Buffer, out: memoryview, layer: int) -> None:
        """Encode one block-layer (raw LKHTD bytes) into ``out`` (exactly ``chunk_bytes``)."""
        x = self._kv(raw, writable=False)
        n = self.codec.encode(x[:, 0], x[:, 1], out=out, first_layer=layer).nbytes
        if n != self.chunk_bytes:
            raise CodecParamsError(f"{self.codec.codec_id} wrote {n} bytes, the link announced {self.chunk_bytes}")

    def decode_into(self, chunk: Buffer, dst: memoryview) -> None:
        """Decode one chunk into the destination's block-layer view (CodecError when it does not decode)."""
        x = self._kv(dst, writable=True)
        self.codec.decode(np.frombuffer(chunk, np.uint8), x[:, 0], x[:, 1], shape=self.shape)
