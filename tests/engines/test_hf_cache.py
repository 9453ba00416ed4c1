"""The in-place cache and the GQA attention: appends land in the buffer, overflow and reorders fall
back to concatenation, and the outputs stay those of stock transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvport.engines.hf import HFEngine
from kvport.engines.hf.cache import ATTENTION, RoomLayer, use_gqa_attention
from kvport.errors import EngineError
from kvport.spec import DType, from_hf_config


def test_room_layer_appends_in_place_then_concatenates_past_its_room() -> None:
    kbuf, vbuf = torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4)
    layer = RoomLayer(kbuf, vbuf, 3)
    assert layer.get_seq_length() == 3
    a, b = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    k, v = layer.update(a, b)
    assert k.shape[2] == 7 and k.data_ptr() == kbuf.data_ptr() and v.data_ptr() == vbuf.data_ptr()
    assert torch.equal(kbuf[:, :, 3:7], a) and torch.equal(vbuf[:, :, 3:7], b)
    c = torch.randn(1, 2, 2, 4)
    k2, _ = layer.update(c, c)  # 9 > 8: a fresh, concatenated tensor; the buffer is left alone
    assert k2.shape[2] == 9 and k2.data_ptr() != kbuf.data_ptr()
    assert torch.equal(k2, torch.cat([kbuf[:, :, :7], c], dim=2))
    k3, _ = layer.update(c[:, :, :1], c[:, :, :1])  # stays an ordinary growing layer from now on
    assert k3.shape[2] == 10 and torch.equal(kbuf[:, :, 7:], torch.zeros(1, 2, 1, 4))


def test_room_layer_falls_back_after_its_tensors_are_replaced() -> None:
    kbuf, vbuf = torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4)
    layer = RoomLayer(kbuf, vbuf, 2)
    layer.batch_select_indices(torch.tensor([0]))  # a new tensor (beam search style reorder)
    a = torch.randn(1, 2, 1, 4)
    k, _ = layer.update(a, a)
    assert k.shape[2] == 3 and k.data_ptr() != kbuf.data_ptr()
    assert torch.equal(kbuf, torch.zeros_like(kbuf))  # never written behind a replaced tensor


def test_room_layer_refuses_buffers_that_cannot_hold_the_tokens() -> None:
    with pytest.raises(EngineError):
        RoomLayer(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), 5)
    with pytest.raises(EngineError):
        RoomLayer(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 5, 4), 1)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Iterator[object]:
    from kvport.refmodel import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m, _ = load(model_dir)
    yield m
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_engine_cache_lives_in_the_landing_buffer_and_matches_stock_transformers(model: object,
                                                                                 model_dir: Path) -> None:
    prompt = np.random.default_rng(7).integers(10, 49_000, 70)
    ids = torch.from_numpy(prompt).unsqueeze(0)
    assert model.config._attn_implementation == "sdpa"  # type: ignore[attr-defined]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,  # type: ignore[attr-defined]
                         do_sample=False, min_new_tokens=12)[0, 70:].tolist()
    eng = HFEngine(model, from_hf_config(model_dir, dtype=DType.FP32), None)
    eng.eos = frozenset()
    assert model.config._attn_implementation == ATTENTION  # type: ignore[attr-defined]
    pf = eng.prefill(prompt, room_tokens=4)  # room for 4 of the 11 decode steps, then concatenation
    k0 = pf.cache.layers[0].keys
    assert k0.shape[2] == 70 and k0.data_ptr() == eng.layout._landing[0, 0].data_ptr()
    assert eng.decode(pf.cache, pf.first_token, 12) == ref
    assert pf.cache.layers[0].keys.shape[2] == 70 + 11


@pytest.mark.slow
def test_gqa_attention_only_replaces_stock_sdpa(model: object) -> None:
    m = model
    before = m.config._attn_implementation  # type: ignore[attr-defined]
    try:
        m.set_attn_implementation("eager")  # type: ignore[attr-defined]
        assert use_gqa_attention(m) is False
        assert m.config._attn_implementation == "eager"  # type: ignore[attr-defined]
        m.set_attn_implementation("sdpa")  # type: ignore[attr-defined]
        assert use_gqa_attention(m) is True and use_gqa_attention(m) is True
    finally:
        m.set_attn_implementation(before)  # type: ignore[attr-defined]


def test_suffix_attention_equals_masked_attention_and_only_takes_the_suffix_mask() -> None:
    import torch.nn.functional as F

    from kvport.engines.hf import cache as C

    g = torch.Generator().manual_seed(1)
    q_len, p, hq, hk, d = 24, 40, 6, 2, 16
    query = torch.randn(1, q_len, hq, d, generator=g).transpose(1, 2)  # as transformers hands it over
    key, value = torch.randn(1, hk, p + q_len, d, generator=g), torch.randn(1, hk, p + q_len, d, generator=g)
    mask = torch.ones(q_len, p + q_len, dtype=torch.bool).tril(p)[None, None]
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert C._is_suffix_causal(mask, q_len, p + q_len)
    got = C._suffix_attention(query, key, value, None)
    assert got is not None and got.shape == (1, q_len, hq, d) and got.is_contiguous()
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    padded = mask.clone()
    padded[..., :3] = False  # left padding: not the plain suffix mask, so the plain path takes it
    assert not C._is_suffix_causal(padded, q_len, p + q_len)
    assert not C._is_suffix_causal(mask, q_len, p + q_len + 1)  # shapes must agree


def test_linear_weights_in_in_out_layout_give_bit_identical_logits(model_dir: Path) -> None:
    from kvport.engines.hf.weights import transpose_linear_weights
    from kvport.refmodel import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, _ = load(model_dir)
        ids = torch.from_numpy(np.random.default_rng(7).integers(10, 49_000, (1, 48)))
        with torch.inference_mode():
            before = m(input_ids=ids).logits
            n = transpose_linear_weights(m)
            after = m(input_ids=ids).logits
        assert n == 7 * m.config.num_hidden_layers  # q, k, v, o, gate, up, down in every layer
        assert torch.equal(before, after)
        assert transpose_linear_weights(m) == 0  # already laid out
        assert not m.model.embed_tokens.weight.t().is_contiguous()  # the embedding (tied head) stays row-major
    finally:
        torch.set_num_threads(threads)
