"""kvport: KV-cache transfer and tiering for LLM serving.

Layers, top to bottom; a module imports only from layers below it (checked by import-linter,
contract in pyproject.toml; names joined by ``|`` share a layer and do not import each other)::

    cli                         `kvport ...` entry points
    report | demo               the benchmarks' JSON as an HTML page of figures and the Markdown reference
                                (`kvport report`); the main job: prefill/decode disaggregation on the
                                reference model
    bench                       benchmark suites (`kvport bench SUITE`), each measuring its physical limit
    eval | workers              quality harness for KV codecs on the reference model; the transformers
                                prefill/decode worker processes (the demo runs them, the fault bench drives them)
    deploy | proxy              what runs around engines (`vllm serve` processes, the PD recipe, TTFT
                                measured in fresh engines); the prefill/decode proxy (`kvport proxy`)
    engines | server            transformers / vLLM adapters (engines/vllm: only what vLLM loads); the
                                shared-tier server (`kvport serve`)
    configfile                  the one config file of a deployment (TOML): typed, checked with file:line:key,
                                KVPORT_* variables over it (kvport serve --config, the connectors, the demo)
    route | sim                 KV-aware routing (the prefix index built from KV events); the discrete-event
                                simulator of a PD deployment replaying a trace (`kvport simulate`)
    planner                     transfer vs recompute vs compress: cost model, calibration, accelerator
                                rooflines
    evidence                    physical limits measured in the same run (memcpy, raw socket, disk, redis),
                                timing, page-cache dropping: what every benchmark compares against
    transfer | client | events  sender/receiver, transports (inproc, shm, tcp, striped, nixl), credits; the
                                client of a kvport server (RemoteTier, the store port); KV events in
                                vLLM's format and their ZeroMQ publisher and subscription
    protocol                    the wire: frames, typed messages, the one handshake, blocking and asyncio shells
    store                       TieredStore: lookup, put/get, promote/evict, prefetch, lifetimes
    ledger                      ownership, leases, pins: the only place that changes a block's owner
    tiers                       host, disk, redis, device tiers and tier wrappers: bytes in, bytes out
    codec | refmodel            KV codecs and the block envelope; locating and loading the reference model
    keys | lifetime             chained block keys; a block's lifetime class (request, session, prefix)
    spec                        KVSpec and sizes
    config                      typed settings (the only reader of KVPORT_* variables)
    units | metrics | memops | extras | deadline | logs
                                unit parsing; the Prometheus registry; the hot paths' memory kernels
                                (native or numpy); optional parts and the one error naming the extra;
                                deadlines of loads; the log format, in kvport's processes and engines'
    _memops                     the native kernels behind memops (C, built at install when it can be)
    errors                      one exception tree
"""

__version__ = "0.1.0"
