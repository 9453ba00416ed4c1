"""Ownership ledger: owners, hand-offs, leases and pins; the only place that changes a block's owner."""
