"""Measured execution of the planner's options on a transformers model (calibration and the benchmark).

KV moves between workers in kvport's canonical block layout (``Layout.LKHTD``), so a run of whole
blocks is one contiguous byte range::

    buffer = [block b][layer l][K|V][head h][token t < block_size][dim d]     (spec.dtype, fp32 here)

``blocks_to_cache`` turns such a buffer (a ``torch.frombuffer`` view, no copy) into a transformers
``DynamicCache``: one strided copy per layer (``DynamicLayer.update`` concatenates onto an empty
tensor), optionally appended to a cache of recomputed head tokens (the split option). Every forward
asks for the last token's logits only (``logits_to_keep=1``), as a serving engine does.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from kvport.errors import PlanInputError
from kvport.spec import KVSpec


def block_view(buf: np.ndarray, spec: KVSpec, nblocks: int) -> torch.Tensor:
    """``buf`` (uint8) as a ``[nblocks, layers, 2, heads, block_size, dim]`` tensor, sharing memory."""
    need = nblocks * spec.bytes_per_block
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes < need:
        raise PlanInputError(f"block buffer must be a flat uint8 array of >= {need} bytes")
    if spec.latent:
        raise PlanInputError("latent (MLA) caches are not supported by the transformers adapter")
    flat = torch.frombuffer(memoryview(buf.data)[:need], dtype=getattr(torch, spec.dtype.torch_name))
    return flat.view(nblocks, spec.num_layers, 2, spec.kv_heads_per_rank, spec.block_size, spec.head_dim)


def cache_to_blocks(cache: Any, spec: KVSpec, start: int, end: int, out: np.ndarray) -> None:
    """Copy tokens ``[start, end)`` (whole blocks) of a DynamicCache into ``out`` in LKHTD block layout."""
    bs = spec.block_size
    if start % bs or end % bs or not 0 <= start < end:
        raise PlanInputError(f"token range [{start}, {end}) is not whole blocks of {bs}")
    nb = (end - start) // bs
    view = block_view(out, spec, nb)
    h, d = spec.kv_heads_per_rank, spec.head_dim
    for li, layer in enumerate(cache.layers):
        for kv, src in ((0, layer.keys), (1, layer.values)):
            part = src[0, :, start:end].reshape(h, nb, bs, d).permute(1, 0, 2, 3)
            view[:, li, kv].copy_(part)


def blocks_to_cache(buf: np.ndarray, spec: KVSpec, nblocks: int, config: Any, head: Any | None = None) -> Any:
    """A DynamicCache holding ``head``'s tokens (if any) followed by ``nblocks`` blocks from ``buf``."""
    from transformers import DynamicCache

    view = block_view(buf, spec, nblocks)
    h, d, t = spec.kv_heads_per_rank, spec.head_dim, nblocks * spec.block_size
    cache = DynamicCache(config=config)
    for li in range(spec.num_layers):
        k = view[:, li, 0].permute(1, 0, 2, 3).reshape(1, h, t, d)
        v = view[:, li, 1].permute(1, 0, 2, 3).reshape(1, h, t, d)
        if head is not None:
            k = torch.cat([head.layers[li].keys, k], dim=2)
            v = torch.cat([head.layers[li].values, v], dim=2)
        cache.update(k, v, li)
    return cache


def forward(model: Any, ids: torch.Tensor, start: int, end: int, cache: Any | None = None) -> tuple[Any, float]:
    """Prefill tokens ``ids[0, start:end]`` after ``cache`` (holding ``start`` tokens); (output, seconds)."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out, time.perf_counter() - t0


def last_logits(out: Any) -> torch.Tensor:
    logits: torch.Tensor = out.logits[0, -1].float()
    return logits
