from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from kvport import memops
from kvport.codec.envelope import ALL_LAYERS, PartKind, header_bytes, parse, tile, write_header
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


def reseal(frame: bytes, body: bytes, parts: list[tuple[PartKind, int, int, int]] | None = None) -> bytes:
    """``frame`` with its body (everything after the header) replaced and the envelope rewritten to
    match, digests included: a value a writer produced that way, not bit rot."""
    env = parse(frame)
    kinds = parts if parts is not None else [(p.kind, p.layer, p.sub, p.length) for p in env.parts]
    tiled = tile(kinds)
    digests = memops.xxh3_many([body[p.offset : p.offset + p.length] for p in tiled])
    h = header_bytes(len(tiled))
    out = bytearray(h + len(body))
    write_header(memoryview(out), env.identity, env.key, env.body, tiled, digests)
    out[h:] = body
    return bytes(out)


def with_meta(frame: bytes, meta: dict[str, Any]) -> bytes:
    """A codec frame whose META part names ``meta`` (padded, sealed), its sections unchanged."""
    env = parse(frame)
    m = msgpack.packb(meta, use_bin_type=True)
    m += bytes(-len(m) % 8)
    sections = bytes(memoryview(frame)[env.header_len + env.parts[0].length :])
    kinds = [(PartKind.META, ALL_LAYERS, 0, len(m))] + [(p.kind, p.layer, p.sub, p.length) for p in env.parts[1:]]
    return reseal(frame, m + sections, kinds)
