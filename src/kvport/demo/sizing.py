"""The demo's memory, sized from the spec and the workload's token bounds before anything starts.

    longest session  L tokens  ->  receive buffer: ceil(L / B) blocks (staging + landing, allocated once)
                               ->  receive budget: two layers of those blocks in flight (at least 4 MiB)
    all sessions     sum ceil(Li / B) blocks x sealed block bytes x 5/4  ->  the shared tier's host pool,
                                                                            the prefill worker's host tier
    kvport serve     --capacity = that pool + SERVER_OVERHEAD (its process baseline and --inflight staging)

A layer of the longest prompt must fit the budget, or the decode worker refuses the transfer
(``one layer ... exceeds the receive budget``); the shared tier must hold every session's blocks, or
eviction costs the next round its history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvport.errors import ConfigError
from kvport.spec import KVSpec

MIN_BUDGET = 4 << 20
_MIB = 1 << 20
# what `kvport serve --capacity` holds besides its host pool: the process itself (~60 MiB measured at
# start) and the demo's --inflight 64MiB of staging, with room to spare
SERVER_OVERHEAD = 192 * _MIB


@dataclass(frozen=True, slots=True)
class Sizing:
    longest_tokens: int
    receive_blocks: int
    receive_budget_bytes: int
    tier_bytes: int  # the shared tier's host pool and the prefill worker's host tier, whole MiB

    @property
    def server_capacity(self) -> str:
        """``kvport serve --capacity``: the pool and the server's own overhead."""
        return f"{(self.tier_bytes + SERVER_OVERHEAD) // _MIB}MiB"

    def as_dict(self) -> dict[str, int]:
        return {"longest_session_tokens": self.longest_tokens, "receive_buffer_blocks": self.receive_blocks,
                "receive_budget_bytes": self.receive_budget_bytes, "shared_tier_pool_bytes": self.tier_bytes,
                "shared_tier_capacity_bytes": self.tier_bytes + SERVER_OVERHEAD}


def size_run(spec: KVSpec, session_tokens: Sequence[int], sealed_block_bytes: int,
             receive_budget_bytes: int | None = None) -> Sizing:
    """Sizes for sessions of at most ``session_tokens`` tokens each; ``receive_budget_bytes``
    overrides the budget (it must still hold one layer of the longest prompt)."""
    if not session_tokens or min(session_tokens) < 1:
        raise ConfigError(f"every session needs a positive token bound, got {list(session_tokens)}")
    longest = max(session_tokens)
    blocks = spec.num_blocks(longest, include_partial=True)
    layer = blocks * spec.bytes_per_layer_block
    budget = receive_budget_bytes if receive_budget_bytes is not None else max(MIN_BUDGET, 2 * layer)
    if budget < layer:
        raise ConfigError(f"a receive budget of {budget} bytes holds no layer of a {longest}-token prompt "
                          f"({layer} bytes)")
    total = sum(spec.num_blocks(n, include_partial=True) for n in session_tokens) * sealed_block_bytes
    tier = -(-(total * 5 // 4) // _MIB) * _MIB
    return Sizing(longest, blocks, budget, tier)
