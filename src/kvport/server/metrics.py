"""The server's Prometheus metrics (declared once in :mod:`kvport.metrics`' registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvport.metrics import counter, gauge

if TYPE_CHECKING:
    from kvport.server.blocks import BlockStore
    from kvport.server.staging import StagingPool


class ServerMetrics:
    def __init__(self) -> None:
        self.requests = counter("server_requests_total", "requests answered, by op and result", ("op", "result"))
        self.rejections = counter("server_rejections_total", "writes refused with a retry-after", ("reason",))
        self.timeouts = counter("server_timeouts_total", "connections closed by a deadline", ("kind",))
        self.auth_failures = counter("server_auth_failures_total", "handshakes refused")
        self.bytes_in = counter("server_bytes_in_total", "value bytes stored")
        self.bytes_out = counter("server_bytes_out_total", "value bytes served")
        self.connections = gauge("server_connections", "authenticated connections open")
        self.used = gauge("server_used_bytes", "charged bytes held, by place", ("place",))
        self.capacity = gauge("server_capacity_bytes", "capacity, by place", ("place",))
        self.blocks = gauge("server_blocks", "blocks stored")
        self.staging = gauge("server_staging_bytes", "staging buffers allocated (values in flight)")

    def observe(self, store: BlockStore, pool: StagingPool) -> None:
        cat = store.catalog
        self.used.labels("host").set(cat.host_used)
        self.used.labels("disk").set(cat.disk_used)
        self.capacity.labels("host").set(cat.host_capacity)
        self.capacity.labels("disk").set(cat.disk_capacity)
        self.blocks.set(len(cat))
        self.staging.set(pool.allocated)
