"""transformers adapter: greedy generation with prefix reuse from a kvport store.

Public API: :class:`HFEngine` (``generate``, and the pieces ``prefill`` / ``decode`` / ``save`` / ``load``
the prefill/decode demo composes), :class:`GenerationResult`, :class:`BlockLayout` (LKHTD blocks <->
cache tensors), :class:`BlockStore` (what a store must offer), :class:`StoreBlocks` (a BlockStore over a
TieredStore), :class:`TierBlocks` (over one tier) and :class:`Lifetime`. Needs the ``hf`` extra.

::

    engine     HFEngine: greedy generation with prefix reuse for Llama-style causal LMs (transformers 5.x)
    port       BlockStore: the three calls the adapter needs from a store, blocks in LKHTD layout
    adapters   StoreBlocks (over a TieredStore) and TierBlocks (over one tier): the BlockStores kvport has
    layout     BlockLayout: transformers' cache tensors <-> kvport's canonical LKHTD blocks
    cache      a cache that appends in place, and GQA attention without expanding K/V
    prefetch   weight prefetch on a spare core: layer i+1's weights read while layer i computes
    weights    linear weights held ``[in, out]`` in memory, the layout MKL multiplies fastest on this path
"""

from kvport.extras import require

try:
    from kvport.engines.hf.adapters import StoreBlocks, TierBlocks
    from kvport.engines.hf.engine import GenerationResult, HFEngine, Loaded, Prefill
    from kvport.engines.hf.layout import BlockLayout, cache_layers, dynamic_cache
    from kvport.engines.hf.port import BlockStore, Lifetime
except ImportError:
    require("hf", __name__)  # torch or transformers not installed: one line naming the extra
    raise  # installed but broken: the original error

__all__ = ["BlockLayout", "BlockStore", "GenerationResult", "HFEngine", "Lifetime", "Loaded", "Prefill", "StoreBlocks",
           "TierBlocks", "cache_layers", "dynamic_cache"]
