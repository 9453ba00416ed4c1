"""Engine adapters: transformers prefix reuse, the vLLM KV connector.

::

    hf      transformers: greedy generation with prefix reuse from a kvport store (the ``hf`` extra)
    vllm    vLLM: the ``KVPortConnector`` KV connector, its PD deployment and its measurement (the ``vllm`` extra)
"""
