"""A cache that appends in place, and GQA attention without expanding K/V (transformers 5.x, CPU).

Two costs of stock transformers land on exactly the path kvport speeds up, a short suffix over a
long loaded prefix (profiled on the reference model, 128 tokens over 1920, one thread):

* ``DynamicLayer.update`` concatenates: every forward copies the whole cached K and V of every layer
  into fresh tensors (fresh memory faults at ~1 GB/s here). :class:`RoomLayer` holds views into a
  preallocated buffer with room for the tokens still to come (kvport's landing buffer, where the
  loaded blocks already sit) and writes new tokens after the valid ones: only the new tokens are
  copied. Out of room (or after an operation that replaced the tensors: a beam reorder, a crop) it
  falls back to the concatenating update, so correctness never depends on the room.
* ``sdpa_attention_forward`` expands K and V to every query head (``repeat_kv``, a full copy per
  layer) whenever an attention mask is present, which a suffix after a cache always needs. torch's
  CPU kernels take masked grouped-query attention directly (``enable_gqa``, the same result bit for
  bit). :func:`use_gqa_attention` registers that variant as the ``kvport_sdpa`` implementation; it
  also turns the boolean mask into its additive form once per forward, not once per layer.

Both give the same outputs as the stock path (the engine tests compare with ``model.generate``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvport.errors import EngineError

ATTENTION = "kvport_sdpa"


class RoomLayer(DynamicLayer):  # type: ignore[misc]  # transformers is untyped here
    """A full-attention layer over ``[1, H, capacity, D]`` buffers; ``keys``/``values`` are the valid
    prefix ``[:, :, :n]`` (so every other cache method sees an ordinary ``DynamicLayer``)."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, tokens: int) -> None:
        super().__init__()
        if kbuf.shape != vbuf.shape or kbuf.dim() != 4 or not 0 <= tokens <= kbuf.shape[2]:
            raise EngineError(f"room buffers {tuple(kbuf.shape)}/{tuple(vbuf.shape)} cannot hold {tokens} tokens")
        self._kbuf: torch.Tensor | None = kbuf
        self._vbuf: torch.Tensor | None = vbuf
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self.keys, self.values = kbuf[:, :, :tokens], vbuf[:, :, :tokens]
        self._mine: tuple[torch.Tensor, torch.Tensor] = (self.keys, self.values)
        self.is_initialized = True

    def _in_room(self, add: torch.Tensor) -> bool:
        kb = self._kbuf
        if kb is None or not self.is_initialized:
            return False
        if self.keys is not self._mine[0] or self.values is not self._mine[1]:
            return False  # the tensors were replaced (reorder, crop, reset): no longer our views
        return add.shape[0] == kb.shape[0] and self.keys.shape[2] + add.shape[2] <= kb.shape[2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = self._kbuf, self._vbuf
        if kb is None or vb is None or not self._in_room(key_states):
            self._kbuf = self._vbuf = None  # from here on an ordinary DynamicLayer
            out: tuple[torch.Tensor, torch.Tensor] = super().update(key_states, value_states, *args, **kwargs)
            return out
        n, t = self.keys.shape[2], key_states.shape[2]
        kb[:, :, n : n + t].copy_(key_states)
        vb[:, :, n : n + t].copy_(value_states)
        self.keys, self.values = kb[:, :, : n + t], vb[:, :, : n + t]
        self._mine = (self.keys, self.values)
        return self.keys, self.values


def room_cache(config: Any, buffers: list[tuple[torch.Tensor, torch.Tensor]], tokens: int) -> Any:
    """A ``DynamicCache`` whose layers are :class:`RoomLayer` over ``buffers`` (per layer K and V,
    ``[1, H, capacity, D]``), the first ``tokens`` of which are valid (no copy)."""
    cache = DynamicCache(config=config)
    if len(cache.layers) != len(buffers):
        raise EngineError(f"model has {len(cache.layers)} cache layers, got {len(buffers)}")
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise EngineError(f"cache layer type {type(layer).__name__} is not supported (full attention only)")
        cache.layers[i] = RoomLayer(buffers[i][0], buffers[i][1], tokens)
    return cache


def _gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, minus the K/V expansion when a mask is present."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.numel() <= _MAX_CACHED:
        attention_mask = _additive(attention_mask, query.dtype)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = q_len > 1 and attention_mask is None and causal
    if causal and kv_len > q_len:  # upper-left alignment would be wrong; only an empty static cache gets here
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


_last_mask: tuple[torch.Tensor, torch.Tensor] | None = None
_MAX_CACHED = 1 << 22  # elements: the additive copy kept until the next forward stays <= 16 MiB


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form (0 / -inf) of a boolean mask, made once per forward: every layer gets the same
    mask object, and SDPA would otherwise convert it again in each layer (2% of a suffix forward)."""
    global _last_mask
    last = _last_mask  # read once: another thread may replace it meanwhile
    if last is None or last[0] is not mask or last[1].dtype != dtype:
        last = (mask, torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf")))
        _last_mask = last
    return last[1]


AttentionInterface.register(ATTENTION, _gqa_sdpa_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_gqa_attention(model: Any) -> bool:
    """Switch a CPU model on stock ``sdpa`` to :data:`ATTENTION`; True if it now uses it."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == ATTENTION:
        return True
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if impl != "sdpa" or not on_cpu:
        return False
    model.set_attn_implementation(ATTENTION)
    return True
