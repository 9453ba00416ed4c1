"""KV-aware routing: send each request to the engine that already holds most of its prefix.

Modules::

    index    PrefixIndex: per engine, the blocks it holds and where, from KV events (pure, bounded)
    vllm_hash  vLLM's own block hashes (what its KV events name device blocks by), without vLLM (pure)
    policy   PrefixRouter: the engine with the lowest predicted TTFT (held prefix vs load), its baselines (pure)
"""
