"""kvport inside SGLang (0.5.23): HiCache's storage backend (its L3), loaded with
``--hicache-storage-backend dynamic`` by module path (docs/sglang.md gives the recipe).

::

    pages      HostPages: SGLang's host KV pool (every ``--hicache-mem-layout``, MHA and MLA) page by page
               as kvport's one stored block format (pure torch; no SGLang import)
    storage    KVPortStorage(HiCacheStorage): batch_exists / batch_get_v1 / batch_set_v1 (zero-copy, host
               pool indices) and the byte-copy calls, over the store the vLLM connector opens (same keys)
"""
