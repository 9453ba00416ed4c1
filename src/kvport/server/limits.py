"""Server limits and backpressure as values.

Every byte a peer can make the server hold is bounded before it is allocated:

- one frame: ``max_header_bytes`` of metadata, ``max_value_bytes`` of payload (checked from the
  fixed-size prefix, before any buffer exists);
- per connection: one value (a connection's requests are served one at a time; what a client
  pipelines waits in the kernel's socket buffer, which TCP flow control bounds);
- in total: values bound for host land straight in reserved pages of the preallocated host pool;
  values staged for disk, or read back from disk, take buffers from one pool of at most
  ``total_inflight_bytes`` (:class:`kvport.server.staging.StagingPool`);
- stored bytes: per-tenant quota (a policy of the store) and the server capacity;
- leases and pins: each client connection is charged at most ``max_held_per_client`` lease-block
  pairs and pins, each tenant (all its connections, open or gone, whatever instance labels they
  gave) at most ``max_held_per_tenant``, and their records at most a budget carved out of the
  capacity (:mod:`kvport.server.held`), charged before anything is recorded; every one lapses at
  its TTL;
- connections: ``max_connections`` in all, of which at most ``max_pending`` still logging in (TCP
  accepted, TLS and kvport handshakes; :mod:`kvport.server.admission`), and ``max_per_peer`` per
  address outside ``per_peer_exempt`` (loopback by default).

When a budget is spent, a write is answered with :class:`Rejected` (reason + retry-after) and its
payload is read and dropped through a small reused scratch buffer, so the connection stays usable
and nothing is buffered without bound. Time limits close idle connections and connections that
start a frame but trickle it (slow-loris), and answers that the peer stops taking
(``write_timeout_s`` without progress, ``frame_timeout_s`` in all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvport.errors import ConfigError
from kvport.protocol.rejects import Rejected, RejectReason
from kvport.server.admission import parse_networks

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_header_bytes: int = 64 << 10
    max_value_bytes: int = 64 * MiB
    total_inflight_bytes: int = 256 * MiB
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 120.0
    frame_timeout_s: float = 30.0  # a frame, once started, must arrive whole (and be answered) within this time
    write_timeout_s: float = 10.0  # an answer the peer takes no byte of for this long is cut
    lease_ttl_s: float = 30.0
    max_lease_ttl_s: float = 600.0
    pin_ttl_s: float = 600.0  # a pin without its own TTL lapses after this (renew by pinning again)
    max_pin_ttl_s: float = 24 * 3600.0
    session_ttl_s: float = 600.0  # a SESSION block without its own TTL: idle time before the pool drops it
    request_ttl_s: float = 60.0  # a REQUEST block without its own TTL
    max_held_per_client: int = 1 << 16  # lease-block pairs + pins one client connection may be charged
    max_held_per_tenant: int = 1 << 18  # ... all clients of one tenant together
    max_connections: int = 1024
    max_pending: int = 64  # connections not logged in yet (TLS handshake included)
    max_per_peer: int = 256  # connections per peer address (0: no cap) ...
    per_peer_exempt: tuple[str, ...] = ("127.0.0.0/8", "::1/128")  # ... except these networks
    max_keys_per_request: int = 4096
    retry_after_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_value_bytes", "total_inflight_bytes", "max_connections",
                     "max_keys_per_request", "max_held_per_client", "max_held_per_tenant", "max_pending"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.max_per_peer < 0:
            raise ConfigError(f"max_per_peer must be 0 (no cap) or positive, got {self.max_per_peer}")
        parse_networks(self.per_peer_exempt)
        if self.total_inflight_bytes < self.max_value_bytes:
            raise ConfigError("total_inflight_bytes must hold at least one value of max_value_bytes")
        for name in ("handshake_timeout_s", "idle_timeout_s", "frame_timeout_s", "lease_ttl_s", "retry_after_s",
                     "pin_ttl_s", "session_ttl_s", "request_ttl_s", "max_lease_ttl_s", "max_pin_ttl_s",
                     "write_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive, finite number of seconds, got {v!r}")


__all__ = ["RejectReason", "Rejected", "ServerLimits"]  # the refusal values are the protocol layer's
