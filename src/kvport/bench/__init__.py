"""Benchmark suites: ``kvport bench SUITE [--quick] [--json PATH]``.

Every suite returns a :class:`~kvport.bench.harness.Report` with ``suite``, ``conditions`` (machine,
CPU count, load, versions, model, sizes), ``limits`` (physical limits measured *in the same run*)
and ``results`` (ratios against those limits). What a suite did not measure is reported as
``None`` ("unknown"), never guessed. Suites are imported lazily, by module path (:data:`SUITES`).
The physical limits and timing are :mod:`kvport.evidence`, below this package. Modules::

    harness        SuiteOptions, Report (suite, conditions, limits, results), conditions, finish
    run            run_suite: a suite by name, its report stamped with mode, command and commit
    codec          size ratio, encode/decode speed and quality per codec
    device         the CUDA device tier against pinned cudaMemcpy of the same bytes (null without CUDA)
    hash           chained block keys per second against raw xxh3-128
    tiers          one request's KV through each tier next to the raw path
    transfer       KV between two processes over TCP and shared memory against the raw link
    transfer_load  the transfer suite's load scenarios on real sockets: layer-wise overlap, 3x overload
    server         the shared tier under many loopback clients next to a raw socket server
    planner        is the planner's choice the fastest option when every option is really run?
    prefix         time to first token with a cached prefix against full recompute
    trace          a Mooncake trace replayed through the store's eviction; hit rate against the optimum
    reshard        prefill and decode at different TP widths (rank processes): heads re-sharded, output equal
    scaleout       the shared tier on a real Redis Cluster against raw RedisCluster; failover and slot moves
    pd_link        scaleout's vLLM PD across an emulated link: the proxy's planner against fixed stream/recompute
    pd             prefill/decode disaggregation in vLLM through kvport, against colocated and NIXL
    simulate       kvport simulate's predictions against the demo, bench pd's rates and published figures
    pd_e2e         pd's end-to-end rates: a client's TTFT, TPOT and goodput, PD against one colocated engine
    route          KV-aware routing over 2 vLLM engines (round-robin, least-loaded, prefix); KV events per second
    soak           ownership under faults for N minutes (nothing leaks or is lost), then memory phases
    soak_client    one client process of the soak
    soak_server    the soak's ``kvport serve`` child and its sampled resident memory
    soak_memory    the soak's memory phases: the server's RSS against its capacity
    faults/        the fault benchmark (a package): no fault changes an answer, hangs or loses a commit
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Suite:
    module: str  # defines ``run(opts: SuiteOptions) -> Report``
    keys: frozenset[str]  # the ``--set`` keys it (its ``<module>_*`` helpers, or its package) reads; others refused


def _suite(module: str, *keys: str) -> Suite:
    return Suite(f"kvport.bench.{module}", frozenset(keys))


SUITES: dict[str, Suite] = {
    "codec": _suite("codec", "codecs", "tokens", "windows"),
    "device": _suite("device"),
    "faults": _suite("faults.suite", "classes", "control", "engine", "hang_s", "injections", "max_new_tokens",
                     "max_tokens", "min_tokens", "progress", "seed"),
    "hash": _suite("hash"),
    "pd": _suite("pd", "answer_tokens", "chats", "e2e", "e2e_answer_tokens", "e2e_sessions", "e2e_turns", "keep",
                 "overload_requests", "peer", "prefix_tokens", "prefixes", "prompt_tokens", "prompts", "rates", "shm",
                 "stream", "suffix_tokens", "tpot_slo_s", "ttft_slo_s", "turns"),
    "route": _suite("route", "answer_tokens", "cache_blocks", "chats", "doc_tokens", "system_prompts", "system_tokens",
                    "think_s", "tier", "turns", "users", "vllm"),
    "reshard": _suite("reshard", "cases", "drop", "max_new_tokens", "take_s", "tokens"),
    "scaleout": _suite("scaleout", "links", "pd", "pd_cores", "pd_stream", "pd_trials", "size", "slots", "trials",
                       "values"),
    "planner": _suite("planner", "bandwidths_mbps", "factors", "lengths", "link", "suffix", "threads", "trials"),
    "server": _suite("server", "capacity_bytes", "client_processes", "inflight_bytes", "io_threads",
                     "overload_factor", "steady_s", "windows"),
    "simulate": _suite("simulate", "demo", "pd", "requests"),
    "soak": _suite("soak", "capacity_bytes", "disk_capacity_bytes", "hits", "hold_s", "kill_every_s", "minutes",
                   "phases", "seed"),
    "prefix": _suite("prefix", "attention", "cached", "engine", "prefetch", "threads", "tokens", "trials", "vllm"),
    "tiers": _suite("tiers", "dir", "tokens", "trials"),
    "transfer": _suite("transfer", "compute", "layerwise_tokens", "mib", "overload_s", "trials"),
    # trace, capacity: also --trace, --capacity
    "trace": _suite("trace", "capacity", "quality", "requests", "sweep", "trace", "traces"),
}
