"""The prefill/decode proxy, a service of its own like :mod:`kvport.server`: ``kvport proxy``.

It speaks the OpenAI API to clients and vLLM's ``kv_transfer_params`` hand-off to the engines behind
it (the typed parameters of :mod:`kvport.engines.vllm.params`); it imports nothing of vLLM (aiohttp,
which vLLM brings).

Modules::

    service     PDProxy / ProxyConfig / serve_proxy(): the aiohttp app, routing, health and metrics
"""
