"""The main job (``kvport demo``): prefill/decode disaggregation of a multi-turn chat on the reference model.

::

    run             ``kvport demo``: the router, the baseline run, the workers and the shared tier; the checks
    workload        the chat workload: one shared system prompt, several users, several rounds each
    messages        control messages between the router and its workers: msgpack maps over a pipe
    prefill_worker  prefill worker process: lookup, planner, load or recompute, layer-wise streaming to decode
    decode_worker   decode worker process: receives each request's KV layer by layer, decodes, stores the session
    shared_tier     the shared KV tier: a ``kvport serve`` child process (host + disk tiers) on 127.0.0.1
    calibrate       a quick calibration (seconds), so the demo's planner decides from measured numbers
    report          the final report: a per-turn table and a summary, as a dict (``--json``) and as rich text
    quiet           silences transformers' progress bars and info logs in the demo's processes
    vllm_run        ``kvport demo --engine vllm``: the same chats through a real vLLM PD deployment
"""
