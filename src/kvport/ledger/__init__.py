"""Ownership ledger: owners, hand-offs, leases and pins; the only place that changes a block's owner.

Public API: :class:`Owner` / :class:`OwnerKind`, :class:`BlockState`, :class:`Move`,
:func:`transition`, :class:`Ledger`, :class:`Lease`, :class:`LeakReport`, :class:`MoveRecord`,
:class:`TransferRecord`.
"""

from kvport.ledger.ledger import LeakReport, Lease, Ledger, MoveRecord, TransferRecord
from kvport.ledger.states import BlockState, Move, Owner, OwnerKind, transition

__all__ = ["BlockState", "LeakReport", "Lease", "Ledger", "Move", "MoveRecord", "Owner", "OwnerKind",
           "TransferRecord", "transition"]
