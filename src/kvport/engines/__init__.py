"""Engine adapters: transformers prefix reuse, the vLLM KV connector, SGLang HiCache's storage backend.

::

    hf      transformers: greedy generation with prefix reuse from a kvport store (the ``hf`` extra)
    vllm    vLLM: the ``KVPortConnector`` KV connector, its PD deployment and its measurement (the ``vllm`` extra)
    sglang  SGLang: ``KVPortStorage``, HiCache's L3 storage backend (``dynamic``), over the store, keys and
            envelopes the vLLM connector uses (the ``sglang`` extra)
"""
