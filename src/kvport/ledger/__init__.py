"""Ownership ledger: owners, hand-offs (also across processes), leases and pins; the only place that
changes a block's owner.

Public API: :class:`Owner` / :class:`OwnerKind`, :class:`BlockState`, :class:`Move`,
:func:`transition`, :class:`Ledger` (with :func:`lease_bytes` and ``PIN_BYTES``: what its records
cost), :class:`Lease`, :class:`Pin`, :class:`BlockRecord`, :class:`LeakReport`, :class:`MoveRecord`,
:class:`TransferRecord`, :class:`Expired`, :func:`new_tid`.

::

    states   Owner / OwnerKind, BlockState, Move and transition(): the one function that moves a block's state
    ledger   Ledger: every block's owner and state, hand-offs, leases and pins
    records  what it hands out (Lease, Pin, MoveRecord, BlockRecord, LeakReport, TransferRecord, Expired),
             what each record costs (lease_bytes, PIN_BYTES) and new_tid, the id of a hand-off in both ledgers
"""

from kvport.ledger.ledger import Ledger
from kvport.ledger.records import (
    PIN_BYTES,
    BlockRecord,
    Expired,
    LeakReport,
    Lease,
    MoveRecord,
    Pin,
    TransferRecord,
    lease_bytes,
    new_tid,
)
from kvport.ledger.states import BlockState, Move, Owner, OwnerKind, transition

__all__ = ["PIN_BYTES", "BlockRecord", "BlockState", "Expired", "LeakReport", "Lease", "Ledger", "Move", "MoveRecord",
           "Owner", "OwnerKind", "Pin", "TransferRecord", "lease_bytes", "new_tid", "transition"]
