"""``kvport simulate``: a discrete-event simulator of a prefill/decode deployment replaying a trace.

Modules, pure first::

    trace       TraceRequest; read_trace / parse_lines / write_trace: Mooncake JSONL, strictly   files
    deployment  Deployment, LinkSpec, TierSpec, CodecSpec, SLO, Compute, FittedCompute: checked   pure
    caches      Hierarchy of Levels: the store's TierIndex and policies holding block ids        pure
    engine      Simulator: arrivals, router, planner choice, prefill, hand-off, decode steps     pure
    results     summarize(): TTFT/TPOT percentiles, goodput at the SLO, hits, bytes, backpressure pure
    sweep       sweep(): the P:D ratio, tier size and link speed with the most goodput per device  pure
    build       Deployments from the CLI's words: devices, rooflines, calibrated CPU, tiers      files

``Simulator(deployment).run(trace)`` then ``summarize(sim, reqs)``; ``kvport bench simulate``
checks its predictions against the demo, ``kvport bench pd`` and published figures.
"""

from kvport.sim.deployment import SLO, CodecSpec, Compute, Deployment, FittedCompute, LinkSpec, TierSpec
from kvport.sim.engine import SimRequest, Simulator
from kvport.sim.results import max_goodput, summarize
from kvport.sim.trace import TraceRequest, parse_lines, read_trace, write_trace

__all__ = ["SLO", "CodecSpec", "Compute", "Deployment", "FittedCompute", "LinkSpec", "SimRequest", "Simulator",
           "TierSpec", "TraceRequest", "max_goodput", "parse_lines", "read_trace", "summarize", "write_trace"]
