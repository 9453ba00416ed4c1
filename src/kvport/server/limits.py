"""Server limits and backpressure as values.

Every byte a peer can make the server hold is bounded before it is allocated:

- one frame: ``max_header_bytes`` of metadata, ``max_value_bytes`` of payload (checked from the
  fixed-size prefix, before any buffer exists);
- per connection: one value (a connection's requests are served one at a time; what a client
  pipelines waits in the kernel's socket buffer, which TCP flow control bounds);
- in total: values bound for host land straight in reserved pages of the preallocated host pool;
  values staged for disk, or read back from disk, take buffers from one pool of at most
  ``total_inflight_bytes`` (:class:`kvport.server.staging.StagingPool`);
- stored bytes: per-tenant quota and the server capacity (:class:`kvport.server.catalog.Catalog`).

When a budget is spent, a write is answered with :class:`Rejected` (reason + retry-after) and its
payload is read and dropped through a small reused scratch buffer, so the connection stays usable
and nothing is buffered without bound. Time limits close idle connections and connections that
start a frame but trickle it (slow-loris).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvport.errors import ConfigError
from kvport.transfer.credits import Rejected, RejectReason

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_header_bytes: int = 64 << 10
    max_value_bytes: int = 64 * MiB
    total_inflight_bytes: int = 256 * MiB
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 120.0
    frame_timeout_s: float = 30.0  # a frame, once started, must arrive whole within this time
    lease_ttl_s: float = 30.0
    max_lease_ttl_s: float = 600.0
    max_connections: int = 1024
    max_keys_per_request: int = 4096
    retry_after_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_value_bytes", "total_inflight_bytes", "max_connections",
                     "max_keys_per_request"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.total_inflight_bytes < self.max_value_bytes:
            raise ConfigError("total_inflight_bytes must hold at least one value of max_value_bytes")
        for name in ("handshake_timeout_s", "idle_timeout_s", "frame_timeout_s", "lease_ttl_s", "retry_after_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")


__all__ = ["RejectReason", "Rejected", "ServerLimits"]  # the refusal values are the transfer layer's
