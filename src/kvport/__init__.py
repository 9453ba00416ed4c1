"""kvport: KV-cache transfer and tiering for LLM serving.

Layers, top to bottom; a module imports only from layers below it (checked by import-linter,
contract in pyproject.toml)::

    cli                         `kvport ...` entry points
    demo                        the main job: prefill/decode disaggregation on the reference model
    bench                       benchmark suites (`kvport bench SUITE`), each measuring its physical limit
    eval                        quality harness for KV codecs on the reference model
    engines | server            transformers / vLLM adapters; the shared-tier server
    planner                     transfer vs recompute vs compress: cost model + calibration
    transfer                    wire format, sender/receiver, transports (inproc, shm, tcp), credits
    store                       TieredStore: lookup, put/get, promote/evict, prefetch, lifetimes
    ledger                      ownership, leases, pins: the only place that changes a block's owner
    tiers                       host, disk, redis, remote, device tiers: bytes in, bytes out
    codec | refmodel            KV codecs; locating and loading the reference model
    keys                        chained block keys
    spec                        KVSpec and sizes
    config                      typed settings (the only reader of KVPORT_* variables)
    units | metrics             unit parsing; the Prometheus registry
    errors                      one exception tree
"""

__version__ = "0.1.0"
