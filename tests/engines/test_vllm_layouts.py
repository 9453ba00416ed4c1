"""Every paged KV layout vLLM's attention backends use: round trips bit-exact in every dtype, a block
saved from one layout loads into any other equal, on the shapes and strides vLLM 0.32 itself declares
(its ``compute_layer_kv_cache_shape_bytes`` / ``compute_layout_strides``), and every layout, backend
or shape kvport does not know refused with the field named."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # no vLLM needed but for the shapes of its own (a GPU machine has none)

from kvport.engines.vllm.paged import PagedKV, PagedLayout, choose_layout  # noqa: E402
from kvport.errors import EngineError  # noqa: E402
from kvport.spec import DType, KVSpec, Layout  # noqa: E402

N, H, B, D, L = 12, 3, 16, 8, 2
DTYPES = [DType.FP32, DType.BF16, DType.FP16, DType.FP8]
SPLIT = [PagedLayout.CPU, PagedLayout.PACKED, PagedLayout.FLASH_ATTN, PagedLayout.FLASHINFER_NHD,
         PagedLayout.FLASHINFER_HND]


def spec(dtype: DType = DType.BF16, latent: bool = False) -> KVSpec:
    if latent:
        return KVSpec("mla-test", L, 1, 4 * D, dtype=dtype, block_size=B, layout=Layout.VLLM_CPU, latent=True)
    return KVSpec("layout-test", L, H, D, dtype=dtype, block_size=B, layout=Layout.VLLM_CPU)


def canonical(s: KVSpec, seed: int) -> list[np.ndarray]:
    """Per layer, the logical KV (N, H, F, B, D) as integers of the element size (any bit pattern)."""
    rng = np.random.default_rng(seed)
    it = {1: np.uint8, 2: np.int16, 4: np.int32}[s.dtype.itemsize]
    shape = (N, s.kv_heads_per_rank, s.kv_factor, B, s.head_dim)
    out = []
    for _ in range(L):
        a = rng.integers(0, 256, size=(*shape, s.dtype.itemsize), dtype=np.uint8)
        if s.dtype is not DType.FP8:
            a[..., -1] &= 0x3F  # finite floats (no NaN patterns: they compare unequal)
        out.append(np.ascontiguousarray(a).view(it)[..., 0])
    return out


def engine(layout: PagedLayout, s: KVSpec, content: list[np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """KV tensors of ``layout`` (zeros, or holding ``content``), written through the layout's own view."""
    dt = getattr(torch, s.dtype.torch_name)
    kv = {}
    for i in range(L):
        t = torch.zeros(layout.shape(s, N), dtype=dt)
        if content is not None:
            view = layout.blocks_view(t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]), s)
            view.copy_(torch.from_numpy(content[i]))
        kv[f"model.layers.{i}.self_attn.attn"] = t
    return kv


def stored(p: PagedKV, ids: np.ndarray) -> np.ndarray:
    """The stored slabs of blocks ``ids``: (n, L, slab_bytes)."""
    out = np.zeros((len(ids), L, p.slab_bytes), dtype=np.uint8)
    for layer in range(L):
        p.gather_layer(layer, ids, out[:, layer])
    return out


@pytest.mark.parametrize(("layout", "dtype"), list(itertools.product(SPLIT, DTYPES)))
def test_every_layout_round_trips_bit_exact_and_stores_one_format(layout: PagedLayout, dtype: DType) -> None:
    s = spec(dtype)
    content = canonical(s, seed=7)
    src = PagedKV(engine(layout, s, content), s, layout)
    ids = np.array([5, 0, 11, 3], dtype=np.int64)
    got = stored(src, ids)
    for layer in range(L):  # the one stored format: (H, 2, B, D) per block-layer, whatever the layout
        assert got[:, layer].tobytes() == np.ascontiguousarray(content[layer][ids]).tobytes()
    dst_kv = engine(layout, s)
    dst = PagedKV(dst_kv, s, layout)
    into = np.array([1, 9, 2, 7], dtype=np.int64)
    for layer in range(L):
        dst.scatter_layer(layer, into, got[:, layer])
    assert stored(dst, into).tobytes() == got.tobytes()
    untouched = np.setdiff1d(np.arange(N), into)
    assert not stored(dst, untouched).any()  # nothing written outside the blocks loaded


@pytest.mark.parametrize(("a", "b"), [(a, b) for a in SPLIT for b in SPLIT if a is not b])
def test_a_block_saved_from_one_layout_loads_equal_into_another(a: PagedLayout, b: PagedLayout) -> None:
    s = spec(DType.BF16)
    content = canonical(s, seed=11)
    src = PagedKV(engine(a, s, content), s, a)
    ids = np.arange(N, dtype=np.int64)[::-1].copy()
    got = stored(src, ids)
    dst = PagedKV(engine(b, s), s, b)
    for layer in range(L):
        dst.scatter_layer(layer, ids, got[:, layer])
    for layer in range(L):  # the same K and V, token by token, read through b's own view
        view = b.blocks_view(dst.layers[layer].view(torch.int16), s).numpy()
        assert np.array_equal(view, content[layer])


def test_the_cpu_layout_splits_k_and_v_as_the_cpu_backend_reads_them() -> None:
    s = spec(DType.FP32)
    t = torch.arange(N * H * B * 2 * D, dtype=torch.float32).view(N, H, B, 2 * D)
    # vLLM's CPU_ATTN: view (N, H, 2B, D), chunk(2, dim=2) -> key_cache, value_cache
    k_cache, v_cache = t.view(N, H, B * 2, D).chunk(2, dim=2)
    view = PagedLayout.CPU.blocks_view(t, s)
    assert torch.equal(view[:, :, 0], k_cache) and torch.equal(view[:, :, 1], v_cache)


def test_packed_reads_k_and_v_as_vllm_0_32s_flash_attention_does() -> None:
    s = spec(DType.FP32)
    t = torch.arange(N * H * B * 2 * D, dtype=torch.float32).view(N, H, B, 2 * D)
    # vllm/v1/attention/backends/flash_attn.py: kv_cache.transpose(1, 2).split(head_size, dim=-1)
    k_cache, v_cache = t.transpose(1, 2).split(D, dim=-1)  # (N, B, H, D)
    view = PagedLayout.PACKED.blocks_view(t, s)  # (N, H, 2, B, D)
    assert torch.equal(view[:, :, 0].transpose(1, 2), k_cache) and torch.equal(view[:, :, 1].transpose(1, 2), v_cache)


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
def test_packed_on_the_views_vllm_0_32_allocates(order: str) -> None:
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheLayout,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
    )

    s = spec(DType.BF16)
    vs = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    shape = compute_layer_kv_cache_shape_bytes(vs, N)  # (B, H, N, C bytes): vLLM's logical per-layer view
    strides = compute_layout_strides(vs, N, L, KVCacheLayout[order])
    raw = torch.zeros(L * strides[0], dtype=torch.uint8)
    kv = {f"model.layers.{i}.self_attn.attn":
          torch.as_strided(raw, shape, strides[1:], i * strides[0]).view(torch.bfloat16) for i in range(L)}
    layout = choose_layout("FLASH_ATTN", next(iter(kv.values())), s)
    assert layout is PagedLayout.PACKED
    content = canonical(s, seed=3)
    for i, t in enumerate(kv.values()):
        layout.blocks_view(t.view(torch.int16), s).copy_(torch.from_numpy(content[i]))
    p = PagedKV(kv, s, layout)
    assert not p.zero_copy  # K and V interleaved per token: the stored slab (K rows, then V rows) is gathered
    ids = np.array([2, 10, 4], dtype=np.int64)
    got = stored(p, ids)
    cpu = PagedKV(engine(PagedLayout.CPU, s), s, PagedLayout.CPU)
    for layer in range(L):
        cpu.scatter_layer(layer, ids, got[:, layer])
        assert np.array_equal(PagedLayout.CPU.blocks_view(cpu.layers[layer].view(torch.int16), s).numpy()[ids],
                              content[layer][ids])
        views = p.slab_views(layer, ids)
        assert b"".join(bytes(v) for v in views) == got[:, layer].tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_latent_round_trips_from_both_shapes_vllm_uses(dtype: DType) -> None:
    s = spec(dtype, latent=True)
    content = canonical(s, seed=5)
    dt = getattr(torch, dtype.torch_name)
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    three = {f"model.layers.{i}.self_attn.attn": torch.from_numpy(content[i][:, 0, 0].copy()).view(dt)
             for i in range(L)}
    four = {n: torch.zeros(N, 1, B, s.head_dim, dtype=dt) for n in three}  # vLLM 0.32's (N, 1, B, D) view
    src = PagedKV(three, s, PagedLayout.MLA)
    dst = PagedKV(four, s, PagedLayout.MLA)
    ids = np.array([0, 6, 3], dtype=np.int64)
    got = stored(src, ids)
    assert got.shape[2] == B * s.head_dim * dtype.itemsize
    for layer in range(L):
        dst.scatter_layer(layer, ids, got[:, layer])
        loaded = four[f"model.layers.{layer}.self_attn.attn"].view(it)[ids, 0].numpy()
        assert np.array_equal(loaded, content[layer][ids, 0, 0])


def test_the_backend_picks_the_layout() -> None:
    s, lat = spec(), spec(latent=True)
    four, five = torch.zeros(N, H, B, 2 * D), torch.zeros(N, 2, B, H, D)
    assert choose_layout("CPU_ATTN", four, s) is PagedLayout.CPU
    assert choose_layout("FLASH_ATTN", four, s) is PagedLayout.PACKED
    assert choose_layout("TRITON_ATTN", four, s) is PagedLayout.PACKED
    assert choose_layout("FLASH_ATTN", torch.zeros(2, N, B, H, D), s) is PagedLayout.FLASH_ATTN
    assert choose_layout("FLASHINFER", five, s) is PagedLayout.FLASHINFER_NHD
    assert choose_layout("FLASHINFER", five, s, "HND") is PagedLayout.FLASHINFER_HND
    assert choose_layout("CUTLASS_MLA", torch.zeros(N, B, 32), lat) is PagedLayout.MLA
    assert choose_layout("CPU_MLA", torch.zeros(N, 1, B, 32), lat) is PagedLayout.MLA


def test_what_kvport_does_not_know_is_refused_with_the_field_named() -> None:
    s, lat = spec(), spec(latent=True)
    with pytest.raises(EngineError, match="FLEX_ATTENTION"):
        choose_layout("FLEX_ATTENTION", torch.zeros(N, H, B, 2 * D), s)
    with pytest.raises(EngineError, match="not an MLA one"):
        choose_layout("FLASH_ATTN", torch.zeros(N, B, 32), lat)
    with pytest.raises(EngineError, match="not latent"):
        choose_layout("CUTLASS_MLA", torch.zeros(N, B, 32), s)
    with pytest.raises(EngineError, match="3-D"):
        choose_layout("FLASH_ATTN", torch.zeros(N, B, 32), s)
    wrong_heads = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, N, B, H + 1, D, dtype=torch.bfloat16)
                   for i in range(L)}
    with pytest.raises(EngineError, match=r"flash_attn layout \(2, 12, 16, 3, 8\)"):
        PagedKV(wrong_heads, s, PagedLayout.FLASH_ATTN)
    mixed = engine(PagedLayout.PACKED, s)
    mixed["model.layers.1.self_attn.attn"] = mixed["model.layers.1.self_attn.attn"].to(torch.float16)
    with pytest.raises(EngineError, match="float16"):
        PagedKV(mixed, s, PagedLayout.PACKED)
    elsewhere = engine(PagedLayout.PACKED, s)
    elsewhere["model.layers.1.self_attn.attn"] = torch.zeros(PagedLayout.PACKED.shape(s, N), dtype=torch.bfloat16,
                                                             device="meta")
    with pytest.raises(EngineError, match="one connector serves one device"):
        PagedKV(elsewhere, s, PagedLayout.PACKED)
    p = PagedKV(engine(PagedLayout.FLASHINFER_HND, s), s, PagedLayout.FLASHINFER_HND)
    with pytest.raises(EngineError, match="outside the engine's 12 blocks"):
        p.scatter_layer(0, np.array([3, 12]), np.zeros((2, p.slab_bytes), dtype=np.uint8))
    assert not p.layers[0].any()  # refused before a byte moved


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the GPU check runs these)")


@needs_cuda
@pytest.mark.parametrize(("layout", "dtype"), list(itertools.product(SPLIT[1:], [DType.BF16, DType.FP8])))
def test_cuda_copies_on_the_side_stream_equal_the_cpu_ones(layout: PagedLayout, dtype: DType) -> None:
    from kvport.engines.vllm.paged import StagingSlots

    s = spec(dtype)
    content = canonical(s, seed=13)
    cpu = PagedKV(engine(layout, s, content), s, layout)
    gpu_kv = {n: t.cuda() for n, t in engine(layout, s, content).items()}
    gpu = PagedKV(gpu_kv, s, layout)
    ids = np.array([7, 1, 4], dtype=np.int64)
    assert stored(gpu, ids).tobytes() == stored(cpu, ids).tobytes()
    staging = StagingSlots(s, len(ids), pinned=True)  # the device tier's and the connector's pinned staging
    for layer in range(L):
        cpu.gather_layer(layer, ids, staging.layer(layer, len(ids)))
    into = np.array([0, 11, 5], dtype=np.int64)
    empty = PagedKV({n: torch.zeros_like(t) for n, t in gpu_kv.items()}, s, layout)
    for layer in range(L):
        empty.scatter_layer(layer, into, staging.layer(layer, len(ids)))
    torch.cuda.synchronize()
    assert stored(empty, into).tobytes() == stored(cpu, ids).tobytes()


@needs_cuda
def test_a_cuda_layer_on_another_device_is_refused() -> None:
    s = spec()
    kv = engine(PagedLayout.PACKED, s)
    kv["model.layers.1.self_attn.attn"] = kv["model.layers.1.self_attn.attn"].cuda()
    with pytest.raises(EngineError, match="one connector serves one device"):
        PagedKV(kv, s, PagedLayout.PACKED)
