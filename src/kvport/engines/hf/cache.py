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

* A suffix after a cached prefix has an all-prefix-then-causal mask; the masked kernel pays for that
  mask on every tile. :func:`_suffix_attention` runs the prefix unmasked and the suffix with a small
  causal mask, query heads stacked per K/V head, and merges the two exactly by log-sum-exp
  (~10% less attention time, 128 tokens over 2048; equal up to float rounding).

The outputs are those of the stock path (the engine tests compare with ``model.generate``).
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
    if attention_mask is not None and dropout == 0.0 and _is_suffix_causal(attention_mask, q_len, kv_len):
        out = _suffix_attention(query, key, value, scaling)
        if out is not None:
            return out, None
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


# ---------------------------------------------------------------------- a suffix after a cached prefix
# The mask of a suffix of q tokens after p cached ones is "every prefix key, then causal among the
# suffix". Attention over the prefix needs no mask at all, and with the query heads of one K/V head
# stacked into one matrix ([H_kv, g*q, D]) the kernel runs larger, unmasked tiles: two partial
# attentions (prefix: no mask; suffix: a q x q causal mask) merged exactly by their log-sum-exp,
# o = lerp(o_prefix, o_suffix, sigmoid(lse_suffix - lse_prefix)). ~10% less attention time at 128
# tokens over 2048 here; the same result up to float rounding (~1e-7).
_SDPA_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_last_shape: tuple[torch.Tensor, bool] | None = None
_suffix_masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}


def _is_suffix_causal(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """True if ``mask`` ([1, 1, q, kv], bool) is exactly all-prefix-then-causal; checked once per
    mask object (every layer of a forward gets the same one)."""
    global _last_shape
    last = _last_shape
    if last is not None and last[0] is mask:
        return last[1]
    ok = False
    if (_SDPA_LSE is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[:2] == (1, 1)
            and 1 < q_len < kv_len and tuple(mask.shape[2:]) == (q_len, kv_len) and mask.device.type == "cpu"):
        p = kv_len - q_len
        tri = torch.ones(q_len, q_len, dtype=torch.bool).tril_()
        ok = bool(mask[0, 0, :, :p].all()) and bool(torch.equal(mask[0, 0, :, p:], tri))
    _last_shape = (mask, ok)
    return ok


def _suffix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float | None) -> torch.Tensor | None:
    """Attention of a ``q``-token suffix over ``kv - q`` cached keys and itself (see above);
    ``[1, q, H, D]`` contiguous, or None when the shapes do not fit (the caller takes the plain path)."""
    b, hq, q_len, d = query.shape
    hk, kv_len = key.shape[1], key.shape[2]
    if b != 1 or hq % hk or query.dtype not in (torch.float32, torch.bfloat16, torch.float16) or _SDPA_LSE is None:
        return None
    g, p = hq // hk, kv_len - q_len
    if g * q_len * q_len > _MAX_CACHED:  # the suffix mask stays small (long suffixes: the plain path)
        return None
    qf = query.reshape(1, hk, g * q_len, d)  # query heads of one K/V head stacked (one small copy)
    mkey = (q_len, g, query.dtype)
    sub = _suffix_masks.get(mkey)
    if sub is None:
        causal = torch.zeros(q_len, q_len, dtype=query.dtype).masked_fill_(
            ~torch.ones(q_len, q_len, dtype=torch.bool).tril_(), float("-inf"))
        sub = causal.repeat(g, 1)
        if len(_suffix_masks) > 8:
            _suffix_masks.clear()
        _suffix_masks[mkey] = sub
    o1, l1 = _SDPA_LSE(qf, key[:, :, :p], value[:, :, :p], scale=scaling)[:2]
    o2, l2 = _SDPA_LSE(qf, key[:, :, p:], value[:, :, p:], attn_mask=sub, scale=scaling)[:2]
    w = torch.sigmoid(l2 - l1).unsqueeze(-1).to(o1.dtype)
    out = torch.lerp(o1, o2, w)  # [1, hk, g*q, d]
    return out.view(1, hk, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(1, q_len, hq, d).contiguous()


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
