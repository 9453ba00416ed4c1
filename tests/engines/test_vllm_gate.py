"""The cost planner gating the vLLM connector's lookups (no vLLM, no I/O)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvport.engines.vllm.config import ConnectorConfig
from kvport.engines.vllm.gate import TIER_SOURCE, gate
from kvport.errors import ConfigError
from kvport.planner import Link, LinkKind, Planner, PrefillModel, Profile
from kvport.spec import DType, KVSpec, Layout

SPEC = KVSpec("m", num_layers=30, num_kv_heads=3, head_dim=64, dtype=DType.FP32, block_size=32,
              layout=Layout.VLLM_CPU)  # 46,080 bytes per token


def _profile(tier_bandwidth: float) -> Profile:
    now = time.time()
    prefill = PrefillModel(model_id=SPEC.model_id, threads=1, a=0.0, b=1e-3, c=0.0, d=0.0, measured_at=now)
    return Profile(machine="test", created=now, prefill=prefill,
                   links=(Link(TIER_SOURCE, LinkKind.TIER, tier_bandwidth, 0.0, now),))


def test_no_planner_loads_every_hit() -> None:
    assert gate(None, SPEC, 2048, 0, 1920) == 1920
    assert gate(Planner(_profile(1e3), machine="test"), SPEC, 2048, 0, 0) == 0


def test_a_fast_tier_loads_and_a_slow_one_recomputes() -> None:
    # 1920 tokens = 88.5 MB: at 1 ms/token recompute costs ~1.9 s; at 100 GB/s loading costs ~1 ms
    assert gate(Planner(_profile(100e9), machine="test"), SPEC, 2048, 0, 1920) == 1920
    # at 1 MB/s loading costs ~88 s: the hit is declined and vLLM recomputes
    assert gate(Planner(_profile(1e6), machine="test"), SPEC, 2048, 0, 1920) == 0


def test_tokens_vllm_already_holds_count_as_cached() -> None:
    # vLLM's own prefix cache holds 1024 tokens; the external hit is the next 896
    assert gate(Planner(_profile(100e9), machine="test"), SPEC, 2048, 1024, 896) == 896


def test_profile_key_in_extra_config(tmp_path: Path) -> None:
    cfg = ConnectorConfig.from_extra_config({"kvport_disk_dir": str(tmp_path), "kvport_profile": "~/p.json"})
    assert cfg.profile_path == Path("~/p.json").expanduser()
    assert ConnectorConfig.from_extra_config({"kvport_disk_dir": str(tmp_path)}).profile_path is None
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra_config({"kvport_disk_dir": str(tmp_path), "kvport_profile": 3})
