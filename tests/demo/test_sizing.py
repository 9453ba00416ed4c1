"""The demo's memory sized from the spec: the receive buffer, its budget and the shared tier."""

from __future__ import annotations

import pytest

from kvport.demo.sizing import MIN_BUDGET, SERVER_OVERHEAD, size_run
from kvport.errors import ConfigError
from kvport.spec import from_preset


def test_buffers_hold_the_longest_session_and_the_tier_holds_them_all() -> None:
    spec = from_preset("smollm2-135m")  # 16-token blocks
    sealed = spec.bytes_per_block + 64
    s = size_run(spec, [4000, 2500, 17], sealed)
    assert s.longest_tokens == 4000 and s.receive_blocks == 250  # 4000 / 16, no partial block
    assert s.receive_budget_bytes == max(MIN_BUDGET, 2 * 250 * spec.bytes_per_layer_block)
    blocks = 250 + 157 + 2  # 2500 -> 156 + a partial one; 17 -> 1 + a partial one
    assert s.tier_bytes >= blocks * sealed * 5 // 4 and s.tier_bytes % (1 << 20) == 0
    assert s.server_capacity == f"{(s.tier_bytes + SERVER_OVERHEAD) >> 20}MiB"
    assert s.as_dict()["receive_buffer_blocks"] == 250


def test_a_budget_below_one_layer_of_the_longest_prompt_is_refused() -> None:
    spec = from_preset("smollm2-135m")
    one_layer = 250 * spec.bytes_per_layer_block
    assert size_run(spec, [4000], 1, receive_budget_bytes=one_layer).receive_budget_bytes == one_layer
    with pytest.raises(ConfigError, match="holds no layer"):
        size_run(spec, [4000], 1, receive_budget_bytes=one_layer - 1)
    with pytest.raises(ConfigError):
        size_run(spec, [], 1)
