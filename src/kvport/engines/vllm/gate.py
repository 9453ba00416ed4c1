"""The cost planner's say over a connector lookup: load the external hit, or decline it and recompute.

vLLM asks ``get_num_new_matched_tokens`` once per request; kvport's answer is the store hit unless the
planner (``kvport.planner.Planner`` with a calibrated profile) predicts that recomputing those tokens is
faster than loading them from the tier, in which case the answer is 0 and vLLM prefills them itself.
The decision and its reason go to the planner's metrics and to the log.
"""

from __future__ import annotations

import logging

from kvport.planner import Action, Cached, Planner, Request
from kvport.spec import KVSpec

log = logging.getLogger(__name__)

TIER_SOURCE = "disk"  # the profile's link name for the connector's DiskTier


def gate(planner: Planner | None, spec: KVSpec, prompt_tokens: int, local_tokens: int, external_tokens: int,
         source: str = TIER_SOURCE) -> int:
    """External tokens to load: ``external_tokens``, or 0 when the planner says recompute is faster."""
    if planner is None or external_tokens <= 0 or prompt_tokens <= 0:
        return external_tokens
    cached = local_tokens + external_tokens
    req = Request(prompt_tokens=max(prompt_tokens, cached), spec=spec, cached=(Cached(source, cached),))
    decision = planner.decide(req)
    if decision.action is Action.RECOMPUTE:
        log.info("kvport: declining %d external tokens: %s", external_tokens, decision.reason)
        return 0
    return external_tokens
