"""The receiver's compatibility check of a transfer's metadata (:class:`TransferMeta`, the
TRANSFER_BEGIN map, is the protocol layer's: :mod:`kvport.protocol.transfer`).

The receiver checks compatibility *before* any payload is accepted: the sender's spec must equal the
receiver's field by field (``KVSpec.first_mismatch``), the codec must be one the receiver accepts;
a mismatch is refused with IncompatibleSpecError naming the field.
"""

from __future__ import annotations

from kvport.errors import IncompatibleSpecError
from kvport.protocol.transfer import TransferMeta
from kvport.spec import KVSpec

__all__ = ["TransferMeta", "check_compatible"]


def check_compatible(mine: KVSpec, theirs: TransferMeta, codecs: tuple[str, ...] = ("raw",)) -> None:
    """Raise IncompatibleSpecError naming the first field that makes the sender's KV unusable here."""
    mm = mine.first_mismatch(theirs.spec)
    if mm is not None:
        raise IncompatibleSpecError(*mm)
    if theirs.codec_id not in codecs:
        raise IncompatibleSpecError("codec", codecs, theirs.codec_id)
    if theirs.codec_id == "raw" and theirs.block_layer_bytes != mine.bytes_per_layer_block:
        raise IncompatibleSpecError("chunk_bytes", mine.bytes_per_layer_block, theirs.block_layer_bytes)
