"""Benchmark suites: ``kvport bench SUITE [--quick] [--json PATH]``.

Every suite returns a :class:`~kvport.bench.harness.Report` with ``suite``, ``conditions`` (machine,
CPU count, load, versions, model, sizes), ``limits`` (physical limits measured *in the same run*)
and ``results`` (ratios against those limits). What a suite did not measure is reported as
``None`` ("unknown"), never guessed. Suites are imported lazily, by module path (:data:`SUITES`).

Modules: the suites, then the parts they share::

    codec           ``bench codec``: size ratio, encode/decode speed and quality per codec, on real KV
    hash            ``bench hash``: chained block keys per second against raw xxh3-128 of the same bytes
    tiers           ``bench tiers``: put/get of one request's KV through each tier, next to the raw path
    transfer        ``bench transfer``: KV between processes over TCP and shm, layer-wise overlap, 3x overload
    server          ``bench server``: the shared tier under 16 loopback clients, next to a raw socket server
    prefix          ``bench prefix``: time to first token with a cached prefix against full recompute
    planner         ``bench planner``: is the planner's choice the fastest option when every option is run?
    trace           ``bench trace``: a Mooncake trace through the store's placement and eviction vs the optimum
    pd              ``bench pd``: PD disaggregation in vLLM through kvport, vs one colocated engine and vs NIXL
    soak            ``bench soak``: ownership under client kills and a server restart, then the server's memory
    faults          ``bench faults``: no fault changes an answer, nothing hangs, nothing committed is lost
    harness         Report (suite, conditions, limits, results) and the timing helpers suites share
    limits          physical limits measured in the same run: memcpy, raw socket, raw disk write + cold read
    soak_client     one client process of the soak (writer, reader, pinner, sender, receiver)
    soak_server     the soak's ``kvport serve`` child process and its resident memory, sampled
    soak_memory     the soak's memory phases: the server's RSS under read hits and under a lease flood
    faults_classes  fault classes on the transfer path: wire checksums, frames, spec mismatch, kills, partition
    faults_store    fault classes on the storage path: server kill and stall, disk damage and full, Redis restart
    faults_vllm     the vLLM rows of the fault matrix (``--set engine=vllm``)
    faults_env      what runs for a fault class (server profile, Redis, proxies), and the server-side checks
    faults_oracle   the fault benchmark's chats and oracle: every answer computed once without kvport
    faults_procs    handles on the real processes it starts, breaks and restarts (server, Redis, proxy, netns)
    faults_proxy    the frame-aware TCP fault proxy (``python -m kvport.bench.faults_proxy``)
    faults_router   the demo's real workers and their transfer link, one request at a time
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
    "faults": _suite("faults", "classes", "control", "engine", "hang_s", "injections", "max_new_tokens",
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
