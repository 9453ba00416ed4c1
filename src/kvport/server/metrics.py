"""The server's Prometheus metrics (declared once in :mod:`kvport.metrics`' registry)."""

from __future__ import annotations

from kvport.metrics import counter, gauge
from kvport.server.held import HeldTally
from kvport.server.staging import StagingPool
from kvport.store import TieredStore
from kvport.tiers.host import HostTier
from kvport.tiers.paged_tier import PagedTier


class ServerMetrics:
    def __init__(self) -> None:
        self.requests = counter("server_requests_total", "requests answered, by op and result", ("op", "result"))
        self.rejections = counter("server_rejections_total", "writes refused with a retry-after", ("reason",))
        self.timeouts = counter("server_timeouts_total", "connections closed by a deadline", ("kind",))
        self.auth_failures = counter("server_auth_failures_total", "handshakes refused")
        self.bytes_in = counter("server_bytes_in_total", "value bytes stored")
        self.bytes_out = counter("server_bytes_out_total", "value bytes served")
        self.connections = gauge("server_connections", "authenticated connections open")
        self.pending = gauge("server_pending_connections", "connections accepted and not logged in yet")
        self.refused = counter("server_refused_connections_total",
                               "connections closed at accept (draining, per_peer, full), or pending ones that "
                               "gave way to a newer one (gave_way)", ("reason",))
        self.used = gauge("server_used_bytes", "charged bytes held, by place (a tier, or held: lease and pin records)",
                          ("place",))
        self.capacity = gauge("server_capacity_bytes", "capacity, by place", ("place",))
        self.resident = gauge("server_resident_bytes", "bytes of a tier's memory faulted in (host: grows as it fills, "
                              "or all of it with --prefault)", ("place",))
        self.blocks = gauge("server_blocks", "blocks stored")
        self.staging = gauge("server_staging_bytes", "staging buffers allocated (values in flight)")
        self.leases = gauge("server_leases", "leases held by clients")
        self.pins = gauge("server_pins", "pins held by clients")

    def observe(self, store: TieredStore, pool: StagingPool, held: HeldTally) -> None:
        st = store.stats()
        for name in store.names:
            self.used.labels(name).set(st.used_bytes[name])
            self.capacity.labels(name).set(store.tiers[name].capacity_bytes)
            tier = store.tiers[name]
            mem = tier.inner if isinstance(tier, PagedTier) else tier
            if isinstance(mem, HostTier):
                self.resident.labels(name).set(mem.resident_bytes)
        self.used.labels("held").set(store.ledger.footprint())
        self.capacity.labels("held").set(held.budget_bytes)
        self.blocks.set(len(store))
        self.staging.set(pool.allocated)
        self.leases.set(len(store.ledger.leases()))
        self.pins.set(sum(1 for _ in store.ledger.pins()))
