"""A quick calibration for the prefill worker's planner (a few seconds), so a fresh machine decides from
measured numbers instead of the planner's safe default (recompute when it cannot vouch for a link).

Measured here, on this machine, now: the reference model's prefill at four (start, end) points
(fitted with :func:`kvport.planner.fit_prefill`), the shared tier's read bandwidth and latency
(one block, then eight blocks, written under throwaway keys and deleted again), and the gather into
the engine's cache (``install_bps``). ``kvport calibrate`` does the thorough version.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from kvport.engines.hf import HFEngine
from kvport.planner import Link, LinkKind, PrefillPoint, Profile, fit_prefill, machine_id
from kvport.tiers import Tier

_POINTS = ((0, 16), (0, 96), (0, 192), (128, 192))


def _prefill_points(eng: HFEngine) -> list[PrefillPoint]:
    from transformers import DynamicCache

    ids = torch.from_numpy(np.random.default_rng(1).integers(10, 49_000, 192)).unsqueeze(0)
    out: list[PrefillPoint] = []
    with torch.inference_mode():
        eng.model(input_ids=ids[:, :32], use_cache=True, logits_to_keep=1)  # warm-up
        for start, end in _POINTS:
            cache = DynamicCache(config=eng.model.config)
            if start:
                eng.model(input_ids=ids[:, :start], past_key_values=cache, use_cache=True, logits_to_keep=1)
            t0 = time.perf_counter()
            eng.model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1)
            out.append(PrefillPoint(start, end, time.perf_counter() - t0))
    return out


def _link(tier: Tier, block_bytes: int, now: float) -> Link:
    blocks = 8
    data = b"\1" * block_bytes
    keys = [b"kvport-calib" + os.urandom(4) for _ in range(blocks)]
    for k in keys:
        tier.put(k, data)
    dst = bytearray(block_bytes)
    try:
        t0 = time.perf_counter()
        tier.get_into(keys[0], dst)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        for k in keys:
            tier.get_into(k, dst)
        many = time.perf_counter() - t0
    finally:
        tier.delete_many(keys)
    per_block = max((many - one) / (blocks - 1), 1e-6)
    return Link(tier.name, LinkKind.TIER, block_bytes / per_block, max(one - per_block, 0.0), now)


def quick_profile(eng: HFEngine, shared: Tier) -> Profile:
    now = time.time()
    pf = fit_prefill(_prefill_points(eng), model_id=eng.spec.model_id, threads=torch.get_num_threads(),
                     measured_at=now)
    n = 16
    eng.layout.reserve(n)
    t0 = time.perf_counter()
    eng.layout.gather_all(n)
    install = n * eng.spec.bytes_per_block / max(time.perf_counter() - t0, 1e-6)
    return Profile(machine=machine_id(), created=now, prefill=pf,
                   links=(_link(shared, eng.spec.bytes_per_block, now),), install_bps=install)
