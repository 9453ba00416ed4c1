"""The prefill/decode worker processes on the transformers engine, and what drives them.

Below the demo (``kvport demo`` runs them on a chat) and the benchmarks (``kvport bench faults``
breaks what they run on), above the engines, the planner and transfer they use. Modules::

    process     Worker: a spawned worker process and its control pipe (ready, call, stop, kill)
    messages    the control messages: msgpack maps over a pipe, lengths capped, no pickle
    prefill     the prefill worker: lookup, planner, load or recompute, stream layer by layer
    decode      the decode worker: receive layer by layer, decode, store the session in the shared tier
    tp_rank     one tensor-parallel rank (prefill or decode) of a re-shard between TP widths
    calibrate   a quick calibration of this machine for the prefill worker's planner
    workload    the demo's sessions (long chats, agents on a shared tool catalogue), token-level turns
    material    what those sessions paste: an incident log, a module and its tests, tools and results
    quiet       silence transformers' progress bars and info logs in the worker processes
"""
