"""KV codecs: raw, lossless, int8, kivi4, mixed. Encode/decode into caller-provided buffers.

::

    codec = get_codec("kivi4", group=128)          # id + params, as carried by keys and wire headers
    enc = codec.encode(k, v, spec)                 # k, v: (layers, heads, tokens, dim) in spec.dtype
    codec.decode(enc, k_out, v_out)                # into caller tensors of the same shape and dtype
    blob = encode_block(codec, spec, block_bytes, key=key)  # bytes form: canonical LKHTD block -> frame
    decode_block(blob, spec, dst, key=key)         # framed bytes -> caller buffer, fully validated
    fmt = block_format(spec)                       # a raw stored block: envelope + the layout's bytes
    fmt.seal(value, key); fmt.open(value, key)     # write the envelope / check it, get the payload

Every stored block and every frame is a block envelope (:mod:`kvport.codec.envelope`): identity
(layout, tp rank, KV head range, spec fingerprint), key, and a manifest of its parts, each with an
xxh3_64; ``stored_bytes(spec)`` is a raw block's size in a store.

Codec ids and params are msgpack-able (``codec_to_dict``) and name the codec in block keys
(``codec_key`` for ``KeyContext.codec_id``).

``raw`` and ``lossless`` need numpy and zstandard only (core); ``int8``, ``kivi4`` and ``mixed`` run
numba kernels (the ``codecs`` extra) and are imported on their first ``get_codec``.
"""

from kvport.codec import lossless, raw  # noqa: F401  (registers the core codecs; the lossy ones load on use)
from kvport.codec.base import Codec, Encoded, KVShape
from kvport.codec.envelope import BlockFormat, block_format, stored_bytes
from kvport.codec.frame import FrameInfo, decode_block, encode_block, max_frame_size, peek_header
from kvport.codec.registry import codec_from_dict, codec_ids, codec_key, codec_to_dict, get_codec

__all__ = ["BlockFormat", "Codec", "Encoded", "FrameInfo", "KVShape", "block_format", "codec_from_dict", "codec_ids",
           "codec_key", "codec_to_dict", "decode_block", "encode_block", "get_codec", "max_frame_size", "peek_header",
           "stored_bytes"]
