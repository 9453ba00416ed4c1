"""Ownership ledger: owners, hand-offs (also across processes), leases and pins; the only place that
changes a block's owner.

Public API: :class:`Owner` / :class:`OwnerKind`, :class:`BlockState`, :class:`Move`,
:func:`transition`, :class:`Ledger`, :class:`Lease`, :class:`Pin`, :class:`BlockRecord`,
:class:`LeakReport`, :class:`MoveRecord`, :class:`TransferRecord`, :class:`Expired`, :func:`new_tid`.
"""

from kvport.ledger.ledger import (
    BlockRecord,
    Expired,
    LeakReport,
    Lease,
    Ledger,
    MoveRecord,
    Pin,
    TransferRecord,
    new_tid,
)
from kvport.ledger.states import BlockState, Move, Owner, OwnerKind, transition

__all__ = ["BlockRecord", "BlockState", "Expired", "LeakReport", "Lease", "Ledger", "Move", "MoveRecord", "Owner",
           "OwnerKind", "Pin", "TransferRecord", "new_tid", "transition"]
