"""Leases and pins are charged before they are recorded: per client and per tenant.

The ledger counts what each holder (``client:tenant/instance``) holds: lease-block pairs and pins.
A tenant names its instances itself, so a cap per holder alone does not bound what one tenant can
make the server keep; :class:`HeldTally` keeps, per tenant, the last count seen for each of its
holders, and their sum::

    charge(tenant, holder, n)   holder's count read again from the ledger; LeaseError when
                                holder + n > per_client or tenant total + n > per_tenant
    note(tenant, holder)        after a lease or pin was recorded, or one was released
    sweep()                     each tick, after the ledger reaped what lapsed: every holder read
                                again, those at 0 forgotten (so the table is bounded by per_tenant)

A holder's count grows only through its own requests (charged, then noted); it shrinks through
release (noted), lapse or a block leaving (seen at the next sweep, <= 1 s later). So the tenant
total is never below what the tenant's leases and pins hold, apart from the one lease each read in
flight holds while it sends (bounded by the connections).
"""

from __future__ import annotations

from kvport.errors import LeaseError
from kvport.ledger import Ledger, Owner


class HeldTally:
    def __init__(self, ledger: Ledger, per_client: int, per_tenant: int) -> None:
        self.ledger = ledger
        self.per_client = per_client
        self.per_tenant = per_tenant
        self._seen: dict[str, dict[Owner, int]] = {}
        self._total: dict[str, int] = {}

    def charge(self, tenant: str, holder: Owner, n: int) -> None:
        """May ``holder`` of ``tenant`` take ``n`` more lease-blocks or pins? LeaseError if not."""
        have = self.note(tenant, holder)
        if have + n > self.per_client:
            raise LeaseError(f"{holder} holds {have} lease-blocks and pins; {n} more would pass the cap of "
                             f"{self.per_client} per client")
        if self.total(tenant) + n > self.per_tenant:
            raise LeaseError(f"tenant {tenant} holds {self.total(tenant)} lease-blocks and pins; {n} more would "
                             f"pass the cap of {self.per_tenant} per tenant")

    def note(self, tenant: str, holder: Owner) -> int:
        """Read ``holder``'s count again; returns it."""
        n = self.ledger.held_by(holder)
        seen = self._seen.setdefault(tenant, {})
        old = seen.pop(holder, 0)
        if n:
            seen[holder] = n
        self._total[tenant] = self._total.get(tenant, 0) + n - old
        return n

    def total(self, tenant: str) -> int:
        return self._total.get(tenant, 0)

    def sweep(self) -> None:
        for tenant, seen in self._seen.items():
            for holder in list(seen):
                self.note(tenant, holder)
