"""Leases and pins are charged before they are recorded: per connection, per tenant, and in bytes.

A lease or pin is *held* by ``client:tenant/instance`` (the instance label is the client's own
choice: it names the holder that may release it, on any connection of that client). It is
*charged* to what the handshake authenticated: the tenant, and the connection that asked
(account ``tenant#connection-id``), never to the label, so no label a client picks lets it use
another's room or escape its own. Three caps, all checked before anything is recorded::

    per connection   lease-block pairs + pins charged to this connection  <= per_client
    per tenant       ... to every connection of the tenant, open or gone  <= per_tenant
    server           bytes of every lease and pin record (Ledger.footprint) <= budget_bytes

A connection that closes leaves its records charged to it (and to its tenant) until they lapse, so
reconnecting, with any label, gives a client new per-connection room but never more than its
tenant's. ``budget_bytes`` is :func:`held_budget` of the server's capacity and is carved out of it
(:mod:`kvport.server.app`): lease floods from any number of tenants never take the process past
``--capacity``. :class:`HeldTally` keeps, per tenant, the last count seen for each of its
accounts, and their sum::

    charge(tenant, account, n, nbytes)  LeaseError past a cap
    note(tenant, account)               after a lease or pin was recorded, or one was released
    sweep()                             each tick, after the ledger reaped what lapsed: every account
                                        read again, those at 0 forgotten (the table is bounded by
                                        per_tenant accounts per tenant)

An account's count grows only through its connection's requests (charged, then noted); it shrinks
through release (noted on whichever connection released it), lapse or a block leaving (seen at the
next sweep, <= 1 s later). So a tenant's total is never below what its leases and pins hold, apart
from the one lease each read in flight holds while it sends (bounded by the connections: at most
``max_connections x lease_bytes(1)`` beyond the budget).
"""

from __future__ import annotations

from kvport.errors import LeaseError
from kvport.ledger import PIN_BYTES, Ledger, lease_bytes

HELD_SHARE = 8  # at most 1/8 of the capacity goes to lease and pin records
RECORD_BYTES = max(lease_bytes(1), PIN_BYTES)  # the dearest record per lease-block or pin


def held_budget(capacity_bytes: int, tenants: int, per_tenant: int) -> int:
    """Bytes set aside for lease and pin records: what every tenant at its cap would take with the
    dearest records, but at most ``capacity / HELD_SHARE``."""
    return min(capacity_bytes // HELD_SHARE, tenants * per_tenant * RECORD_BYTES)


def account(tenant: str, conn_id: int) -> str:
    """What a connection's leases and pins are charged to (conn ids are never reused by a server)."""
    return f"{tenant}#{conn_id}"


class HeldTally:
    def __init__(self, ledger: Ledger, per_client: int, per_tenant: int, budget_bytes: int) -> None:
        self.ledger = ledger
        self.per_client = per_client
        self.per_tenant = per_tenant
        self.budget_bytes = budget_bytes
        self._seen: dict[str, dict[str, int]] = {}
        self._total: dict[str, int] = {}

    def charge(self, tenant: str, acct: str, n: int, nbytes: int) -> None:
        """May connection ``acct`` of ``tenant`` take ``n`` more lease-blocks or pins, of ``nbytes``
        record bytes? LeaseError if not."""
        have = self.note(tenant, acct)
        if have + n > self.per_client:
            raise LeaseError(f"this connection holds {have} lease-blocks and pins; {n} more would pass the cap of "
                             f"{self.per_client} per client connection")
        if self.total(tenant) + n > self.per_tenant:
            raise LeaseError(f"tenant {tenant} holds {self.total(tenant)} lease-blocks and pins; {n} more would "
                             f"pass the cap of {self.per_tenant} per tenant")
        used = self.ledger.footprint()
        if used + nbytes > self.budget_bytes:
            raise LeaseError(f"lease and pin records take {used} bytes; {nbytes} more would pass the server's "
                             f"budget of {self.budget_bytes} bytes for them")

    def note(self, tenant: str, acct: str) -> int:
        """Read ``acct``'s count again; returns it."""
        n = self.ledger.held_by(acct)
        seen = self._seen.setdefault(tenant, {})
        old = seen.pop(acct, 0)
        if n:
            seen[acct] = n
        self._total[tenant] = self._total.get(tenant, 0) + n - old
        return n

    def total(self, tenant: str) -> int:
        return self._total.get(tenant, 0)

    def sweep(self) -> None:
        for tenant, seen in self._seen.items():
            for acct in list(seen):
                self.note(tenant, acct)
