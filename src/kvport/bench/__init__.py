"""Benchmark suites: ``kvport bench SUITE [--quick] [--json PATH]``.

Every suite returns a :class:`~kvport.bench.harness.Report` with ``suite``, ``conditions`` (machine,
CPU count, load, versions, model, sizes), ``limits`` (physical limits measured *in the same run*)
and ``results`` (ratios against those limits). What a suite did not measure is reported as
``None`` ("unknown"), never guessed. Suites are imported lazily, by module path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Suite:
    module: str  # defines ``run(opts: SuiteOptions) -> Report``
    keys: frozenset[str]  # the ``--set`` keys it (or a ``<module>_*`` helper of it) reads; any other is refused


def _suite(module: str, *keys: str) -> Suite:
    return Suite(f"kvport.bench.{module}", frozenset(keys))


SUITES: dict[str, Suite] = {
    "codec": _suite("codec", "codecs", "tokens", "windows"),
    "faults": _suite("faults.suite", "classes", "control", "engine", "hang_s", "injections", "max_new_tokens",
                     "max_tokens", "min_tokens", "progress", "seed"),
    "hash": _suite("hash"),
    "pd": _suite("pd", "answer_tokens", "chats", "keep", "overload_requests", "peer", "prompt_tokens", "prompts",
                 "shm", "stream", "turns"),
    "planner": _suite("planner", "bandwidths_mbps", "factors", "lengths", "suffix", "threads", "trials"),
    "server": _suite("server", "capacity_bytes", "client_processes", "inflight_bytes", "io_threads",
                     "overload_factor", "steady_s", "windows"),
    "soak": _suite("soak", "capacity_bytes", "disk_capacity_bytes", "hits", "hold_s", "kill_every_s", "minutes",
                   "phases", "seed"),
    "prefix": _suite("prefix", "cached", "prefetch", "threads", "tokens", "trials", "vllm"),
    "tiers": _suite("tiers", "dir", "tokens", "trials"),
    "transfer": _suite("transfer", "compute", "layerwise_tokens", "mib", "overload_s", "trials"),
    "trace": _suite("trace", "capacity", "requests", "sweep", "trace"),  # trace, capacity: also --trace, --capacity
}
