"""KV-aware routing: send each request to the engine that already holds most of its prefix.

Modules::

    index    PrefixIndex: per engine, the blocks it holds and where, from KV events (pure, bounded)
    policy   PrefixRouter: the engine with the lowest predicted TTFT (held prefix vs load), its baselines (pure)
"""
