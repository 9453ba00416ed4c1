"""Where the codec meets attention: a transformers attention function that encodes and decodes
K (after rotary embedding) and V exactly where attention reads them, then runs SDPA.

The function is registered once with ``AttentionInterface`` as ``kvport_codec``; which codec runs is
decided per attention module by its ``kvport_kv_hook`` attribute (None: plain SDPA, the baseline),
so no global state is shared between models. Each call encodes one layer's range
``(1, heads, tokens, dim)`` in the KV dtype (fp32 by default, so only the codec's own error is
measured; ``bf16`` adds the cache's rounding) and decodes it into reused buffers; the hook counts
the encoded bytes so that the reported ratio (against bf16) is the one really achieved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvport.codec import Codec
from kvport.codec.base import torch_dtype
from kvport.spec import DType

ATTN_NAME = "kvport_codec"
_registered = False


@dataclass(slots=True)
class KVHook:
    """Encode + decode K and V of one attention call with ``codec``; counts bytes."""

    codec: Codec
    kv_dtype: DType = DType.FP32
    payload_bytes: int = 0
    bf16_bytes: int = 0
    layer: int = 0  # the model layer of the current call (codecs with per-layer tables use it)
    _bufs: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)

    def __call__(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, s, d = key.shape
        shape = (b, h, s, d)
        if shape not in self._bufs:
            dt = torch_dtype(self.kv_dtype)
            self._bufs[shape] = (torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt),
                                 torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt))
        kin, vin, kout, vout = self._bufs[shape]
        kin.copy_(key)
        vin.copy_(value)
        # batch axis = the "layers" axis of a (1, H, T, D) range, which is model layer ``self.layer``
        enc = self.codec.encode(kin, vin, first_layer=self.layer)
        self.codec.decode(enc, kout, vout)
        if self.kv_dtype is not DType.BF16 and self.codec.lossless:
            # raw / lossless sizes depend on the input bytes: count them on a bf16 copy
            enc = self.codec.encode(key.to(torch.bfloat16), value.to(torch.bfloat16))
        self.payload_bytes += enc.nbytes
        self.bf16_bytes += enc.shape.bf16_bytes
        return kout.to(key.dtype), vout.to(value.dtype)

    @property
    def ratio(self) -> float | None:
        return self.bf16_bytes / self.payload_bytes if self.payload_bytes else None


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hook: KVHook | KVCapture | None = getattr(module, "kvport_kv_hook", None)
    if hook is not None:
        if getattr(hook, "wants_query", False):
            hook.observe_query(query, key, int(module.layer_idx))  # type: ignore[union-attr]
        if isinstance(hook, KVHook):
            hook.layer = int(module.layer_idx)
        key, value = hook(key, value)
    out: tuple[torch.Tensor, None] = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out


def install(model: Any) -> None:
    """Route ``model``'s attention through :func:`_attention` (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _attention)
        _registered = True
    model.set_attn_implementation(ATTN_NAME)


def set_hook(model: Any, hook: KVHook | KVCapture | None) -> None:
    """Attach ``hook`` to every attention module of ``model`` (None restores the baseline)."""
    for mod in model.modules():
        if hasattr(mod, "layer_idx") and hasattr(mod, "k_proj"):
            mod.kvport_kv_hook = hook


@dataclass(slots=True)
class KVCapture:
    """Records each attention call's K (after RoPE) and V unchanged, in layer order."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.append(key[0].detach().clone())
        self.values.append(value[0].detach().clone())
        return key, value


def capture_kv(model: Any, ids: torch.Tensor, dtype: DType = DType.BF16) -> tuple[torch.Tensor, torch.Tensor]:
    """Real K and V of one forward over ``ids``: two ``(layers, heads, tokens, dim)`` tensors."""
    install(model)
    cap = KVCapture()
    set_hook(model, cap)
    try:
        with torch.inference_mode():
            model(ids[None], use_cache=False)
    finally:
        set_hook(model, None)
    dt = torch_dtype(dtype)
    return torch.stack(cap.keys).to(dt).contiguous(), torch.stack(cap.values).to(dt).contiguous()
