"""Transfer vs recompute vs compress: cost model, calibration profile, live planner.

Modules, pure first::

    profile.py    Profile (PrefillModel, Link, CodecCost): measured costs + JSON file      pure
    fit.py        fit_prefill: t(s, e) = a + b q + c q^2 + d q s from measured points      pure
    cost.py       Request/Cached/Load -> evaluate() -> Decision                            pure
    crossover.py  crossover(): prompt lengths where load and recompute swap places         pure
    planner.py    Planner: decide() + observe_transfer/observe_prefill (EMA), metrics, log
    throttle.py   LoopbackPeer: a KV peer process serving byte ranges through a token bucket  sockets
    hfkv.py       block bytes <-> transformers DynamicCache; timed forwards                   torch
    calibrate.py  measures this machine (prefill of a model, install, links, tiers, codecs) torch

Engines and the store call ``Planner(profile).decide(Request(...))`` before loading, act on
``decision.action``, then report what really happened with ``observe_transfer`` / ``observe_prefill``.
"""

from kvport.planner.cost import Action, Cached, Decision, Freshness, Load, Option, ProfileStatus, Request, evaluate
from kvport.planner.crossover import Crossover, crossover
from kvport.planner.fit import fit_prefill
from kvport.planner.planner import Planner
from kvport.planner.profile import CodecCost, Link, LinkKind, PrefillModel, PrefillPoint, Profile, machine_id

__all__ = [
    "Action", "Cached", "CodecCost", "Crossover", "Decision", "Freshness", "Link", "LinkKind", "Load", "Option",
    "Planner", "PrefillModel", "PrefillPoint", "Profile", "ProfileStatus", "Request", "crossover", "evaluate",
    "fit_prefill", "machine_id",
]
