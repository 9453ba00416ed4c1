"""Hand-built profiles: numbers chosen so that crossovers have closed forms."""

from __future__ import annotations

import pytest

from kvport.planner import Link, LinkKind, PrefillModel, Profile
from kvport.spec import KVSpec, from_preset

NOW = 1_800_000_000.0
MACHINE = "test-cpu x2"


def smollm_fp32() -> KVSpec:
    return from_preset("smollm2-135m", dtype="fp32")  # 46,080 bytes per token


def linear_prefill(model_id: str, per_token: float = 1e-3, a: float = 0.0) -> PrefillModel:
    return PrefillModel(model_id=model_id, threads=2, a=a, b=per_token, c=0.0, d=0.0, measured_at=NOW)


def profile_with(bandwidth: float, prefill: PrefillModel | None, latency: float = 0.0, **kw: object) -> Profile:
    links = (Link("peer", LinkKind.PEER, bandwidth, latency, NOW),)
    return Profile(machine=MACHINE, created=NOW, prefill=prefill, links=links, **kw)  # type: ignore[arg-type]


@pytest.fixture
def spec() -> KVSpec:
    return smollm_fp32()
