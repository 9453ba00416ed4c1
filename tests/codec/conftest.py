from __future__ import annotations

import pytest
import torch

from kvport.spec import DType, KVSpec


@pytest.fixture()
def spec() -> KVSpec:
    return KVSpec(model_id="test/tiny", num_layers=2, num_kv_heads=3, head_dim=64, dtype=DType.BF16, block_size=16)


def kv(layers: int = 2, heads: int = 3, tokens: int = 37, dim: int = 64, dtype: torch.dtype = torch.bfloat16,
       seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K with a few outlier channels and a sink token (like real keys), V plain."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, tokens, dim, generator=g)
    k[..., :4] *= 8.0
    k[:, :, 0] *= 5.0
    v = torch.randn(layers, heads, tokens, dim, generator=g) * 0.5
    return k.to(dtype), v.to(dtype)
