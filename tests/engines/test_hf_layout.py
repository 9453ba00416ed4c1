"""LKHTD blocks <-> transformers cache tensors: exact round trips, no model needed."""

import pytest
import torch

from kvport.engines.hf import BlockLayout, cache_layers, dynamic_cache
from kvport.errors import BufferMismatchError
from kvport.spec import DType, KVSpec


def _spec() -> KVSpec:
    return KVSpec(model_id="tiny", num_layers=3, num_kv_heads=2, head_dim=4, dtype=DType.FP32, block_size=4)


def _layers(spec: KVSpec, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shape = (1, spec.num_kv_heads, tokens, spec.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(spec.num_layers)]


def test_scatter_puts_tokens_where_lkhtd_says() -> None:
    spec = _spec()
    layers = _layers(spec, 14)
    lay = BlockLayout(spec)
    blocks = lay.scatter_from_cache(layers, first_block=1, n_blocks=2)
    assert blocks.shape == (2, *spec.block_shape) and blocks.is_contiguous()
    # block j, layer l, K/V kv, head h, token t  ==  cache layer l, head h, token (1 + j) * 4 + t
    for j in range(2):
        for layer in range(3):
            for kv in range(2):
                want = layers[layer][kv][0, :, (1 + j) * 4 : (2 + j) * 4]
                assert torch.equal(blocks[j, layer, kv], want)
    assert blocks[0].nbytes == spec.bytes_per_block


def test_gather_is_the_inverse_of_scatter_and_cache_adopts_views() -> None:
    from transformers import LlamaConfig

    spec = _spec()
    layers = _layers(spec, 12)
    lay = BlockLayout(spec)
    staged = lay.scatter_from_cache(layers, 0, 3).clone()
    lay.staging(3).zero_()
    lay.staging(3).copy_(staged)
    got = lay.gather_all(3)
    for (k, v), (k2, v2) in zip(layers, got, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    one = lay.gather_layer(3, 1)
    assert torch.equal(one[0], layers[1][0])
    cfg = LlamaConfig(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, hidden_size=8)
    cache = dynamic_cache(cfg, got)
    assert cache.get_seq_length() == 12
    assert all(a[0] is b[0] for a, b in zip(cache_layers(cache), got, strict=True))  # adopted, not copied


def test_gather_block_from_raw_bytes_lands_where_gather_all_puts_it() -> None:
    spec = _spec()
    layers = _layers(spec, 12)
    lay = BlockLayout(spec)
    staged = lay.scatter_from_cache(layers, 0, 3).clone()
    other = BlockLayout(spec, capacity_blocks=3)
    for i in (2, 0, 1):  # any order: each block goes to its own slot
        other.gather_block(i, memoryview(staged[i].numpy().tobytes()).toreadonly())
    got = [(other._landing[i, 0, :, :, :12], other._landing[i, 1, :, :, :12]) for i in range(spec.num_layers)]
    for (k, v), (k2, v2) in zip(layers, got, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    from kvport.errors import EngineError

    three = BlockLayout(spec, capacity_blocks=3)
    three.gather_block(0, memoryview(staged.numpy().tobytes()).toreadonly())  # a run of 3 blocks in one copy
    assert torch.equal(three._landing[:, :, :, :, :12], other._landing[:, :, :, :, :12])
    with pytest.raises(EngineError):
        other.gather_block(3, memoryview(staged[0].numpy().tobytes()))  # past the reserved blocks
    with pytest.raises(EngineError):
        other.gather_block(1, memoryview(staged.numpy().tobytes()))  # 3 blocks from slot 1 overrun
    with pytest.raises(EngineError):
        other.gather_block(0, memoryview(b"\0" * (spec.bytes_per_block - 4)))  # not a whole block


def test_scatter_refuses_a_cache_of_the_wrong_shape() -> None:
    spec = _spec()
    lay = BlockLayout(spec)
    with pytest.raises(BufferMismatchError):
        lay.scatter_from_cache(_layers(spec, 12)[:2], 0, 3)
    with pytest.raises(BufferMismatchError):
        lay.scatter_from_cache(_layers(spec, 7), 0, 2)  # 7 tokens hold only one full block


def test_scatter_layer_pads_the_partial_tail_block() -> None:
    spec = _spec()
    layers = _layers(spec, 10)  # two full blocks of 4 and a tail of 2
    lay = BlockLayout(spec, capacity_blocks=3)
    lay.staging(3).fill_(7.0)
    for i, (k, v) in enumerate(layers):
        assert lay.scatter_layer(i, k, v, first_block=1, tokens=10) == 3
    st = lay.staging(3)
    assert torch.all(st[0] == 7.0)  # block 0 untouched (it came from the store)
    for i, (k, _v) in enumerate(layers):
        assert torch.equal(st[1, i, 0], k[0, :, 4:8])
        assert torch.equal(st[2, i, 0, :, :2], k[0, :, 8:10])
        assert torch.all(st[2, i, :, :, 2:] == 0)
