"""Deployments from the words of ``kvport simulate``: a model, a device, tiers, links, an SLO.

Compute: ``--device NAME`` is the roofline of that accelerator (:mod:`kvport.planner.roofline`);
``--device cpu`` with a calibration profile of the same model (``kvport calibrate``) uses the
profile's measured prefill model instead, and the decode step of the measured CPU roofline; the
answer's ``compute`` field says which basis each engine used.

Tiers: ``--tier NAME:SCOPE:CAPACITY:BANDWIDTH[:LATENCY_S[:POLICY]]``, e.g. ``host:engine:512GiB:20GB/s``
(each prefill engine's host RAM, read over PCIe) or ``pool:shared:2TiB:100Gbps:0.0002`` (one shared
pool for all, read over the network). The device's own prefix cache is ``--device-cache`` tokens
(``auto``: what fits next to the weights, as vLLM's gpu_memory_utilization 0.9 leaves it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvport.errors import ProfileError, SimInputError, UnitError
from kvport.planner.arch import model_arch
from kvport.planner.devices import CPU, accelerator
from kvport.planner.profile import Profile
from kvport.planner.roofline import DEFAULT_PREFILL_EFFICIENCY, Roofline
from kvport.sim.deployment import Compute, LinkSpec, TierSpec
from kvport.store.eviction import DEFAULT_POLICY
from kvport.units import parse_bandwidth, parse_size


@dataclass(frozen=True, slots=True)
class CalibratedCompute:
    """A calibration profile's prefill model (this machine, measured) and a roofline's decode step."""

    profile_prefill: Any  # kvport.planner.PrefillModel
    roofline: Roofline
    where: str

    @property
    def basis(self) -> str:
        return f"calibrated prefill ({self.where}); decode {self.roofline.basis}"

    def prefill_seconds(self, cached: int, tokens: int) -> float:
        return float(self.profile_prefill.seconds(cached, tokens))

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        return self.roofline.decode_step_seconds(batch, context_tokens)


def compute_for(model: str, device: str, *, dtype: str | None = None, tp: int = 1,
                efficiency: float = DEFAULT_PREFILL_EFFICIENCY, profile_path: Path | None = None,
                explicit_profile: bool = False) -> tuple[Compute, Roofline, str]:
    """The engine's compute, the roofline behind it (its memory sizes are the deployment's) and, when
    ``cpu`` is not calibrated, why. A profile asked for by name (``explicit_profile``) that is missing,
    unreadable or of another model is an error, not a silent fall back to the roofline."""
    arch = model_arch(model)
    acc = accelerator(device)
    dt = dtype or ("fp32" if acc.name == CPU else arch.kv.dtype.value)
    roof = Roofline(arch, acc, dt, prefill_efficiency=efficiency, tp=tp)
    if acc.name != CPU or profile_path is None:
        return roof, roof, ""
    why = ""
    try:
        prof = Profile.load(profile_path)
    except ProfileError as exc:
        why = f"no usable calibration profile ({exc})"
    else:
        if prof.prefill is None:
            why = f"profile {profile_path} has no prefill measurements"
        elif prof.prefill.model_id != arch.model_id:
            why = f"profile {profile_path} measured {prof.prefill.model_id}, not {arch.model_id}"
        else:
            return CalibratedCompute(prof.prefill, roof, str(profile_path)), roof, ""
    if explicit_profile:
        raise SimInputError(f"--profile: {why}")
    return roof, roof, why


def parse_tier(text: str) -> TierSpec:
    """``NAME:SCOPE:CAPACITY:BANDWIDTH[:LATENCY_S[:POLICY]]``."""
    parts = text.split(":")
    if len(parts) < 4 or len(parts) > 6:
        raise SimInputError(f"--tier {text!r}: expected NAME:SCOPE:CAPACITY:BANDWIDTH[:LATENCY_S[:POLICY]], "
                            "e.g. pool:shared:2TiB:100Gbps:0.0002")
    name, scope, cap, bw = parts[:4]
    try:
        latency = float(parts[4]) if len(parts) > 4 and parts[4] else 0.0
    except ValueError as exc:
        raise SimInputError(f"--tier {text!r}: latency {parts[4]!r} is not a number of seconds") from exc
    policy = parts[5] if len(parts) > 5 else DEFAULT_POLICY
    try:
        capacity = parse_size(cap)
    except UnitError as exc:
        raise SimInputError(f"--tier {text!r}: capacity {cap!r}: {exc}") from exc
    try:
        bandwidth = parse_bandwidth(bw)
    except UnitError as exc:
        raise SimInputError(f"--tier {text!r}: bandwidth {bw!r}: {exc}") from exc
    return TierSpec(name, capacity, LinkSpec(bandwidth, latency), scope=scope, policy=policy)


def device_cache_tokens(value: str, roof: Roofline, fraction: float = 0.5) -> int:
    """``--device-cache``: a token count, or ``auto``: ``fraction`` of the KV room next to the weights
    (the rest is the running requests' own KV)."""
    if value == "auto":
        return int(roof.kv_capacity_tokens() * fraction)
    if not (value.isascii() and value.isdigit()):
        raise SimInputError(f"--device-cache must be a token count or 'auto', got {value!r}")
    return int(value)


def link_of(bandwidth: float | None, latency: float, roof: Roofline) -> tuple[LinkSpec, str]:
    if bandwidth is None:
        return LinkSpec(roof.accelerator.interconnect, latency), \
            f"the device's interconnect ({roof.accelerator.name})"
    return LinkSpec(bandwidth, latency), "--link"
