"""CodecTier: a tier that keeps blocks codec-encoded (the store's per-tier codec choice).

Wraps any tier; the store sees raw blocks in their envelope (:class:`kvport.codec.envelope.BlockFormat`
of ``spec``: header, manifest, the canonical LKHTD block; ``stored_bytes(spec)`` bytes), the inner tier
holds self-describing frames (:func:`kvport.codec.encode_block`: the same identity and key, the
codec id and params as a META part, each section of the codec payload as a part with its check)::

    TieredStore([HostTier(...),                                   # hot: raw, zero-copy reads
                 CodecTier(DiskTier(...), get_codec("int8"), spec)])  # cold: 1.9x more blocks

* ``put`` checks the raw block's envelope (its key, identity and every part), encodes its payload
  into a reused buffer and puts the frame; a value that is no sealed block of ``spec`` under that
  key is refused (:class:`BufferMismatchError`): no frame is ever made of unchecked bytes.
* ``get_into`` reads the frame and decodes it straight into the caller's buffer after every check of
  :func:`kvport.codec.decode_block` (identity and key included), then seals the raw envelope in
  front of it (part digests of the decoded bytes, hashed while in cache). A frame that fails them (bit
  rot, truncation, a section or META missing, a frame of another spec, rank or key, an old frame
  without a manifest) is dropped and reported as :class:`CorruptBlockError`, so the next get is a
  clean miss: never wrong data. Frames of another codec decode too (they describe themselves), so
  changing a persistent tier's codec keeps its blocks.
* ``charge`` is the frame's size: the store's byte budget for the tier counts what it really holds,
  so a tier with a 2x codec holds twice the blocks.
* Lossy codecs change the values (int8, kivi4, mixed): a block read back is the codec's
  approximation, as measured by ``kvport eval quality``; ``lossless`` is exact.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np

from kvport.codec import Codec, decode_block, encode_block, max_frame_size
from kvport.codec.envelope import BlockFormat
from kvport.errors import BlockNotFoundError, BufferMismatchError, CodecError, CorruptBlockError
from kvport.spec import KVSpec, Layout
from kvport.tiers.base import Buffer, Tier, TierCaps, byte_view, writable_view


class CodecTier(Tier):
    def __init__(self, inner: Tier, codec: Codec, spec: KVSpec, *, name: str | None = None) -> None:
        self.inner, self.codec, self.spec = inner, codec, spec
        self.name = name or inner.name
        if spec.layout is not Layout.LKHTD:
            raise BufferMismatchError(f"{self.name}: codecs encode canonical lkhtd blocks, not {spec.layout.value}")
        try:
            self.format = BlockFormat(spec)  # the raw blocks the store puts and gets
            self.frame_bytes = max_frame_size(codec, spec)
        except CodecError as exc:
            raise BufferMismatchError(f"{self.name}: a {codec.codec_id} tier cannot hold blocks of this spec "
                                      f"({exc})") from exc
        self.block_bytes = self.format.value_bytes
        if self.frame_bytes > inner.caps.max_value_bytes:
            raise BufferMismatchError(f"{self.name}: a {codec.codec_id} frame of {self.frame_bytes} bytes exceeds "
                                      f"the inner tier's max value")
        c = inner.caps
        self.caps = TierCaps(persistent=c.persistent, shared=c.shared, zero_copy_read=False,
                             max_value_bytes=self.block_bytes, native_ttl=c.native_ttl, device=c.device)
        self._enc = np.empty(self.frame_bytes, np.uint8)  # reused: encode and decode stage through it
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def charge(self, nbytes: int) -> int:
        return self.inner.charge(self.frame_bytes)

    def _block(self, data: Buffer) -> memoryview:
        mv = byte_view(data)
        if mv.nbytes != self.block_bytes:
            raise BufferMismatchError(f"{self.name}: a value here is one {self.block_bytes}-byte block, "
                                      f"got {mv.nbytes} bytes")
        return mv

    def _payload(self, key: bytes, data: Buffer) -> memoryview:
        """The canonical block inside the sealed value ``data`` stored under ``key``, checked."""
        try:
            return self.format.open(self._block(data), key)
        except CodecError as exc:
            raise BufferMismatchError(f"{self.name}: value for {key.hex()} is no sealed block of this spec "
                                      f"({exc})") from exc

    def put(self, key: bytes, data: Buffer, *, ttl_s: float | None = None) -> None:
        src = self._payload(key, data)
        with self._lock:
            self.inner.put(key, encode_block(self.codec, self.spec, src, key=key, out=self._enc), ttl_s=ttl_s)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], *, ttl_s: float | None = None) -> None:
        frames = [(k, bytes(encode_block(self.codec, self.spec, self._payload(k, d), key=k))) for k, d in items]
        self.inner.put_many(frames, ttl_s=ttl_s)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        out = writable_view(dst, self.block_bytes)
        with self._lock:
            buf = self._enc
            try:
                n = self.inner.get_into(key, buf)
            except BufferMismatchError as exc:  # larger than our frames: another codec's (or not a frame)
                size = self.inner.size_of(key)
                if size is None or size > 2 * self.block_bytes + (1 << 16):
                    self.inner.delete(key)
                    raise CorruptBlockError(f"{self.name}: block {key.hex()} is no frame of this spec; "
                                            "dropped") from exc
                buf = np.empty(size, np.uint8)
                n = self.inner.get_into(key, buf)
            value = out[: self.block_bytes]
            try:
                decode_block(buf[:n], self.spec, self.format.payload(value), key=key)
            except CodecError as exc:
                self.inner.delete(key)
                raise CorruptBlockError(f"{self.name}: block {key.hex()} does not decode ({exc}); dropped") from exc
            self.format.seal(value, key)
        return self.block_bytes

    def size_of(self, key: bytes) -> int | None:
        return None if self.inner.size_of(key) is None else self.block_bytes

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    def get(self, key: bytes) -> bytes:
        if not self.inner.contains(key):
            raise BlockNotFoundError(f"{self.name}: no block {key.hex()}")
        buf = bytearray(self.block_bytes)
        self.get_into(key, buf)
        return bytes(buf)

    def close(self) -> None:
        self.inner.close()
