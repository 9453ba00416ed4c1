"""Transfer vs recompute vs compress: cost model, calibration profile, live planner.

Modules, pure first::

    profile     Profile (PrefillModel, Link, CodecCost): measured costs + JSON file        pure
    fit         fit_prefill: t(s, e) = a + b q + c q^2 + d q s from measured points        pure
    cost        Request/Cached/Load -> evaluate() -> Decision                              pure
    crossover   crossover(): prompt lengths where load and recompute swap places           pure
    devices     Accelerator presets from vendors' data sheets; measure_cpu() times this CPU
    arch        ModelArch: shapes beyond the KV, parameter counts                          pure
    roofline    Roofline: prefill/decode seconds from FLOPs and bytes                      pure
    quality     codec quality costs from ``kvport eval quality`` result files              files
    planner     Planner: decide() + observe_transfer/observe_prefill (EMA), metrics, log
    pd          prefill/decode per request: stream or recompute (PDPlanner, fitted from a proxy's requests)
    throttle    LoopbackPeer: a KV peer process serving byte ranges through a token bucket  sockets
    hfkv        block bytes <-> transformers DynamicCache; timed forwards                  torch
    calibrate   measures this machine (prefill of a model, install, links, tiers, codecs)  torch

Engines and the store call ``Planner(profile).decide(Request(...))`` before loading, act on
``decision.action``, then report what really happened with ``observe_transfer`` / ``observe_prefill``.
"""

from kvport.planner.arch import ModelArch, model_arch
from kvport.planner.cost import Action, Cached, Decision, Freshness, Load, Option, ProfileStatus, Request, evaluate
from kvport.planner.crossover import Crossover, crossover
from kvport.planner.devices import ACCELERATORS, Accelerator, accelerator, device_names, measure_cpu
from kvport.planner.fit import fit_prefill
from kvport.planner.planner import Planner
from kvport.planner.profile import CodecCost, Link, LinkKind, PrefillModel, PrefillPoint, Profile, machine_id
from kvport.planner.roofline import Roofline, RooflineEstimate, RooflinePrefill

__all__ = [
    "ACCELERATORS", "Accelerator", "Action", "Cached", "CodecCost", "Crossover", "Decision", "Freshness", "Link",
    "LinkKind", "Load", "ModelArch", "Option", "Planner", "PrefillModel", "PrefillPoint", "Profile", "ProfileStatus",
    "Request", "Roofline", "RooflineEstimate", "RooflinePrefill", "accelerator", "crossover", "device_names",
    "evaluate", "fit_prefill", "machine_id", "measure_cpu", "model_arch",
]
