"""What runs around the engines: their processes, the deployment recipe, and measurement through them.

Above :mod:`kvport.engines` (it starts engines that load the connector by module path, each in a
child process: only ``vllm_runner``, that child's main, imports vLLM) and beside :mod:`kvport.proxy` (started as
``kvport proxy`` in a child process, never imported); used by the demo, the benchmarks and the
tests, so that the documented deployment is the tested one.

Modules::

    vllm_runner   one vLLM engine job in a fresh process (``python -m kvport.deploy.vllm_runner``)
    vllm_measure  prefix_ttft(): TTFT loaded-from-kvport vs recompute, each in a fresh engine process
    vllm_bench    the entry ``kvport bench prefix`` calls for its ``results.vllm`` half
    vllm_serve    EngineServer (one ``vllm serve`` in a role), KVPortServer, ProxyServer: a PD deployment,
                  and its recipe (``python -m kvport.deploy.vllm_serve``)
    sglang_serve  SGLangServer: one SGLang server with HiCache and kvport's (or SGLang's file) L3 backend
    sglang_bench  prefix_ttft(): ``kvport bench prefix --set engine=sglang``, kvport vs the file backend vs recompute
    layout        choose(): PD or colocated for a host, from a ``kvport bench pd`` report or the measured rule
    redis_cluster  RedisClusterProcs: a real Redis Cluster on this host (3 + 3 nodes), and its faults
                   on demand (a node killed or paused, slots migrated while serving)
"""
