"""The receiver's compatibility check of a transfer's metadata (:class:`TransferMeta`, the
TRANSFER_BEGIN map, is the protocol layer's: :mod:`kvport.protocol.transfer`).

The receiver checks compatibility *before* any payload is accepted: the sender's spec must equal the
receiver's field by field (``KVSpec.first_mismatch``), the codec must be one the receiver accepts;
a mismatch is refused with IncompatibleSpecError naming the field. A receiver that re-shards
accepts the heads of another TP width that are some of its own (``reshard=True``).
"""

from __future__ import annotations

from kvport.errors import IncompatibleSpecError
from kvport.protocol.transfer import TransferMeta
from kvport.spec import TP_FIELDS, KVSpec

__all__ = ["TransferMeta", "check_compatible"]


def check_compatible(mine: KVSpec, theirs: TransferMeta, codecs: tuple[str, ...] = ("raw",),
                     reshard: bool = False) -> None:
    """Raise IncompatibleSpecError naming the first field that makes the sender's KV unusable here.

    ``reshard``: a receiver that assembles its heads from senders of another TP width
    (:mod:`kvport.transfer.reshard`) accepts a spec that differs in ``tp_size`` / ``tp_rank`` only,
    when the heads it carries are some of this rank's (else the field named is ``head_range``);
    without it a spec of another TP width is refused naming ``tp_size``."""
    mm = mine.first_mismatch(theirs.spec, TP_FIELDS if reshard else ())
    if mm is not None:
        raise IncompatibleSpecError(*mm)
    if reshard:
        (lo, hi), (mlo, mhi) = theirs.spec.head_range, mine.head_range
        if not mlo <= lo < hi <= mhi:
            raise IncompatibleSpecError("head_range", (mlo, mhi), (lo, hi))
    if theirs.codec_id not in codecs:
        raise IncompatibleSpecError("codec", codecs, theirs.codec_id)
    if theirs.codec_id == "raw" and theirs.block_layer_bytes != theirs.spec.bytes_per_layer_block:
        raise IncompatibleSpecError("chunk_bytes", theirs.spec.bytes_per_layer_block, theirs.block_layer_bytes)
