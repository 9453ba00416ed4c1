"""The server's state: what every connection, handler and report reads, apart from the code that reads it.

::

    store, ledger      the TieredStore and its ledger (:mod:`kvport.server.storage`): blocks, owners,
                       leases, pins, quotas, placement
    tenants            the tenant table (tokens, quotas, key salting)
    limits, wire_limits  ServerLimits; the frame caps once a connection is logged in
    metrics            the server's Prometheus collectors
    pool, scratch      staging buffers for values in flight; the reused buffer that drains refused payloads
    held, admission    leases and pins charged per connection / tenant / bytes; who may hold a connection
    logged_in, hits    the tenant of every logged-in connection; GETs served per stored block
    draining, started  a graceful shutdown is under way; when the server started (monotonic)

Imports go one way: ``state`` <- ``connection`` (a connection's lifecycle) <- ``handlers`` (one method
per request) <- ``app``; ``reports`` reads the state too. Nothing here knows a connection object: a
connection is its id (and, once logged in, its tenant).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Collection

from kvport.protocol.frame import Limits
from kvport.server.admission import Admission, parse_networks
from kvport.server.held import HeldTally
from kvport.server.limits import ServerLimits
from kvport.server.metrics import ServerMetrics
from kvport.server.staging import StagingPool
from kvport.server.tenants import Tenant, TenantTable
from kvport.store import TieredStore

_HITS_SLACK = 64  # prune the hit counts once they hold more than 2 x blocks stored + this many


class HitCounts:
    """GETs served per stored block (storage key), for STATS' top prefixes.

    A block leaves (evicted, expired, deleted) without the handlers hearing of it, so the counts of
    blocks that left are dropped lazily: a GET that finds more than ``2 x stored + 64`` counts
    drops every count whose block is gone. What stays is at most the blocks stored, so after any
    GET the table holds at most ``2 x stored + 64`` counts however many blocks a busy server has
    evicted (the store's blocks are bounded by its capacity), and a prune costs O(1) per GET
    amortised (it drops more than half of what it reads: the index heap's rule,
    :mod:`kvport.store.index`). Every stored block keeps its exact count; a block stored again
    before a prune keeps the count it had (the same key is the same prefix).
    """

    def __init__(self, stored: TieredStore) -> None:
        self._stored = stored
        self._n: dict[bytes, int] = {}

    def hit(self, key: bytes) -> None:
        self._n[key] = self._n.get(key, 0) + 1
        if len(self._n) > 2 * len(self._stored) + _HITS_SLACK:
            self.prune()

    def prune(self) -> None:
        stored = self._stored
        self._n = {k: n for k, n in self._n.items() if k in stored}

    def top(self, among: Collection[bytes], n: int) -> list[tuple[bytes, int]]:
        """The ``n`` most read blocks of ``among`` with their counts, most read first."""
        return heapq.nlargest(n, ((k, c) for k, c in self._n.items() if k in among), key=lambda kc: kc[1])

    def __len__(self) -> int:
        return len(self._n)


class ServerState:
    def __init__(self, store: TieredStore, tenants: TenantTable, limits: ServerLimits, metrics: ServerMetrics,
                 page_bytes: int, held_budget_bytes: int, server_name: str = "kvport-serve") -> None:
        self.store = store
        self.ledger = store.ledger
        self.tenants = tenants
        self.limits = limits
        self.metrics = metrics
        self.page_bytes = page_bytes
        self.server_name = server_name
        self.pool = StagingPool(limits.total_inflight_bytes)
        self.scratch = memoryview(bytearray(1 << 20))  # drains refused payloads; never grows
        self.wire_limits = Limits(max_meta_bytes=limits.max_header_bytes, max_payload_bytes=limits.max_value_bytes,
                                  max_chunk_bytes=page_bytes, max_chunks=-(-limits.max_value_bytes // page_bytes))
        self.draining = False
        self.started = time.monotonic()
        self.logged_in: dict[int, Tenant] = {}  # connection id -> its tenant
        self.held = HeldTally(self.ledger, limits.max_held_per_client, limits.max_held_per_tenant, held_budget_bytes)
        self.admission = Admission(limits.max_connections, limits.max_pending, limits.max_per_peer,
                                   parse_networks(limits.per_peer_exempt))
        self.hits = HitCounts(store)  # GETs served per stored block (inspect's top prefixes)

    # ------------------------------------------------------------ connections
    def connection_ready(self, conn_id: int, tenant: Tenant) -> None:
        self.logged_in[conn_id] = tenant
        self.admission.logged_in(conn_id)
        self._count_connections()

    def connection_closed(self, conn_id: int) -> None:
        self.logged_in.pop(conn_id, None)  # its client's leases and pins lapse at their TTL
        self.admission.closed(conn_id)
        self._count_connections()

    def _count_connections(self) -> None:
        self.metrics.connections.set(len(self.logged_in))
        self.metrics.pending.set(self.admission.pending)

    def tick(self) -> None:
        """Periodic: lifetimes (store), leases and pins past their TTL (ledger), gauges."""
        self.store.expire()
        self.ledger.expire()
        self.held.sweep()
        self.metrics.observe(self.store, self.pool, self.held)
