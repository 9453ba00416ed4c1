"""The prefill/decode proxy and KV-aware router, a service of its own like :mod:`kvport.server`: ``kvport proxy``.

It speaks the OpenAI API to clients and vLLM's ``kv_transfer_params`` hand-off to the engines behind
it (the typed parameters of :mod:`kvport.engines.vllm.params`); it imports nothing of vLLM (aiohttp,
which vLLM brings).

Modules::

    service     PDProxy / ProxyConfig / serve_proxy(): the aiohttp app, the PD path, health and metrics
    routing     Engines: each engine's KV events (into a PrefixIndex) and load (its /metrics), the choice
"""
