"""kvport as SGLang HiCache's storage backend, at SGLang's interface: its real host pools (every
layout, MHA and MLA), its storage config, its backend factory (``dynamic``) and its failure injector;
kvport's real store (host RAM, disk, the kvport server). Every call and every layout; bad pages,
evicted pages and a shared tier that goes down are misses, never an exception into SGLang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvport.engines.sglang.pages import HostPages
from kvport.planner import Link, LinkKind, Planner, PrefillModel, Profile
from tests.engines.sglang_support import (
    StorageBackendFactory,
    backend,
    mha_pool,
    mla_model,
    mla_pool,
    names,
    page_indices,
    storage_config,
)
from tests.server.conftest import ServerProc, base_args

P = 16
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def _pages(be: object) -> torch.Tensor:
    pages = be.pages  # type: ignore[attr-defined]
    assert isinstance(pages, HostPages)
    return pages.pages


def _same(a: object, first_a: int, b: object, first_b: int, n: int) -> bool:
    """Pages first_a.. of backend a's pool hold the same KV as pages first_b.. of b's (canonical view)."""
    pa, pb = _pages(a), _pages(b)
    return all(torch.equal(pa[first_a + i], pb[first_b + i]) for i in range(n))


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_zero_copy_round_trip_every_layout(layout: str, model_dir: Path, tmp_path: Path) -> None:
    pool = mha_pool(layout)
    be = backend(pool, model_dir, {"kvport_disk_dir": str(tmp_path / "kv"), "kvport_host_capacity": "32MiB"})
    keys = names(4)
    before = [pool.get_data_page(i * P, flat=True).clone() for i in range(2, 6)]
    assert be.batch_exists(keys) == 0
    assert be.batch_set_v1(keys, page_indices(2, 4)) == [True] * 4
    assert be.batch_exists(keys) == 4
    assert be.batch_exists([*keys[:2], names(1, salt=9)[0], keys[3]]) == 2  # the leading run only
    pool.kv_buffer.zero_()
    assert be.batch_get_v1(keys, page_indices(10, 4)) == [True] * 4
    # SGLang's own view of the loaded pages: the bytes it saved, in its own layout
    assert all(torch.equal(pool.get_data_page((10 + i) * P, flat=True), before[i]) for i in range(4))
    assert be.stats["loaded"] == 4
    be.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_single_tensor_pages(layout: str, tmp_path: Path) -> None:
    model = mla_model(tmp_path)
    pool = mla_pool(layout)
    be = backend(pool, model, {"kvport_disk_dir": str(tmp_path / "kv")}, mla=True)
    assert be.spec.latent and _pages(be).shape[1:] == (4, P, 96)
    before = [pool.get_data_page(i * P, flat=True).clone() for i in range(3)]
    assert be.batch_set_v1(names(3), page_indices(0, 3)) == [True] * 3
    pool.kv_buffer.zero_()
    assert be.batch_get_v1(names(3), page_indices(5, 3)) == [True] * 3
    assert all(torch.equal(pool.get_data_page((5 + i) * P, flat=True), before[i]) for i in range(3))
    # a latent cache is the same on every rank: rank 1 of 2 reads rank 0's pages
    other = backend(mla_pool(layout), model, {"kvport_disk_dir": str(tmp_path / "kv")}, mla=True,
                    tp_rank=1, tp_size=2)
    assert other.batch_exists(names(3)) == 3
    be.close()
    other.close()


def test_pages_cross_host_layouts(model_dir: Path, tmp_path: Path) -> None:
    """One stored format: pages saved by a layer-first engine load into a page-first one (and back)."""
    disk = {"kvport_disk_dir": str(tmp_path / "kv")}
    lf = backend(mha_pool("layer_first"), model_dir, disk)
    pf = backend(mha_pool("page_first"), model_dir, disk)
    assert lf.batch_set_v1(names(3), page_indices(1, 3)) == [True] * 3
    assert pf.batch_exists(names(3)) == 3
    assert pf.batch_get_v1(names(3), page_indices(7, 3)) == [True] * 3
    assert _same(lf, 1, pf, 7, 3)
    lf.close()
    pf.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_byte_copy_calls(layout: str, model_dir: Path, tmp_path: Path) -> None:
    """SGLang's generic path: flat pages in its layout (get_data_page / get_dummy_flat_data_page)."""
    pool = mha_pool(layout)
    be = backend(pool, model_dir, {"kvport_disk_dir": str(tmp_path / "kv")})
    pages = [pool.get_data_page(i * P, flat=True).clone() for i in range(3)]
    assert be.batch_set(names(3), pages) is True
    assert be.exists(names(3)[1]) and not be.exists(names(1, salt=5)[0])
    targets = [torch.zeros_like(p) for p in pages]
    got = be.batch_get(names(3), targets)
    assert all(g is t for g, t in zip(got, targets, strict=True))
    assert all(torch.equal(t, p) for t, p in zip(targets, pages, strict=True))
    assert be.get(names(1, salt=7)[0], torch.zeros_like(pages[0])) is None
    assert be.set(names(1, salt=8)[0], pages[0]) is True and be.exists(names(1, salt=8)[0])
    # the zero-copy calls read what the byte-copy calls wrote
    assert be.batch_get_v1(names(3), page_indices(9, 3)) == [True] * 3
    assert all(torch.equal(pool.get_data_page((9 + i) * P, flat=True), pages[i]) for i in range(3))
    be.close()


def test_keys_carry_rank_width_model_and_tenant(model_dir: Path, tmp_path: Path) -> None:
    disk = {"kvport_disk_dir": str(tmp_path / "kv")}
    be = backend(mha_pool("layer_first"), model_dir, disk)
    assert be.batch_set_v1(names(2), page_indices(0, 2)) == [True] * 2
    # the model's 3 KV heads over TP 3: rank 1 holds one head, another spec, other keys
    other_rank = backend(mha_pool("layer_first", heads=1), model_dir, disk, tp_rank=1, tp_size=3)
    assert other_rank.batch_exists(names(2)) == 0
    salted = backend(mha_pool("layer_first"), model_dir, {**disk, "kvport_tenant_salt": "ab12"})
    assert salted.batch_exists(names(2)) == 0
    revised = backend(mha_pool("layer_first"), model_dir, {**disk, "kvport_model_revision": "ft-2"})
    assert revised.batch_exists(names(2)) == 0
    same = backend(mha_pool("page_head"), model_dir, disk)
    assert same.batch_exists(names(2)) == 2
    for b in (be, other_rank, salted, revised, same):
        b.close()


def test_pool_that_is_not_the_model_refused(model_dir: Path, tmp_path: Path) -> None:
    from kvport.errors import EngineError

    with pytest.raises(EngineError, match="does not match the model"):
        backend(mha_pool("layer_first", heads=2), model_dir, {"kvport_disk_dir": str(tmp_path)})
    with pytest.raises(EngineError, match="local folder"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(tmp_path / "no-such-model", {"kvport_disk_dir": str(tmp_path)}), None)


def test_corrupt_partial_and_evicted_pages_are_misses(model_dir: Path, tmp_path: Path) -> None:
    pool = mha_pool("layer_first")
    be = backend(pool, model_dir, {"kvport_disk_dir": str(tmp_path / "kv")})
    keys = names(5)
    assert be.batch_set_v1(keys, page_indices(0, 5)) == [True] * 5
    store, kv = be.store, be.keys_of(keys)
    good = [bytearray(be.format.value_bytes) for _ in keys]
    for k, buf in zip(kv, good, strict=True):
        store.get_into(k, buf)
    bad = bytearray(good[1])
    bad[-100] ^= 0xFF  # one bit of layer 29's V
    store.delete(kv[1])  # (its descendants go with it: a block never outlives its parent)
    store.put(kv[1], bytes(bad))
    untouched = _pages(be)[21:25].clone()
    assert be.batch_get_v1(keys, page_indices(20, 5)) == [True] + [False] * 4
    assert be.stats["refused"] == 1 and not store.contains(kv[1])  # the refused page is gone
    assert torch.equal(_pages(be)[21:25], untouched)  # nothing after the bad page reached the pool
    # a truncated page (a partial write)
    store.put(kv[1], bytes(good[1][: len(good[1]) // 2]))
    assert be.batch_get_v1(keys[:2], page_indices(20, 2)) == [True, False]
    # another page's value under this key (intact, but not this page): refused, never linked
    store.delete(kv[1])
    store.put(kv[1], bytes(good[2]))
    assert be.batch_get_v1(keys[:2], page_indices(20, 2)) == [True, False]
    assert be.stats["refused"] == 2
    # evicted between batch_exists and batch_get_v1
    assert be.batch_set_v1(keys, page_indices(0, 5)) == [True] * 5
    assert be.batch_exists(keys) == 5
    store.delete(kv[3])
    assert be.batch_get_v1(keys, page_indices(20, 5)) == [True, True, True, False, False]
    assert torch.equal(_pages(be)[20:23], _pages(be)[0:3])
    be.close()


def test_bad_calls_never_raise(model_dir: Path, tmp_path: Path) -> None:
    be = backend(mha_pool("layer_first"), model_dir, {"kvport_disk_dir": str(tmp_path / "kv")})
    assert be.batch_set_v1(names(2), page_indices(0, 2)) == [True, True]
    unaligned = page_indices(0, 2) + 3
    assert be.batch_get_v1(names(2), unaligned) == [False, False]
    assert be.batch_set_v1(names(2), unaligned) == [False, False]
    assert be.batch_get_v1(names(2), page_indices(0, 1)) == [False, False]  # too few indices
    assert be.batch_exists(["not a page hash" * 100]) == 0
    assert be.batch_exists([]) == 0
    assert be.batch_get(names(1), [torch.zeros(3)]) == [None]  # a target that is not a page
    assert be.batch_set(names(1), [torch.zeros(3)]) is False
    assert be.stats["loaded"] == 0
    be.close()


def test_shared_tier_down_is_a_miss(model_dir: Path) -> None:
    server = ServerProc(base_args("256MiB")).start()
    try:
        be = backend(mha_pool("layer_first"), model_dir, {"kvport_server": f"127.0.0.1:{server.port}",
                                                          "kvport_server_write": "through",
                                                          "kvport_load_deadline": "0.5:4:2"})
        reader = backend(mha_pool("page_first"), model_dir, {"kvport_server": f"127.0.0.1:{server.port}"})
        assert be.batch_set_v1(names(3), page_indices(0, 3)) == [True] * 3
        assert reader.batch_exists(names(3)) == 3  # another engine finds them in the shared tier
        assert reader.batch_get_v1(names(3), page_indices(4, 3)) == [True] * 3
        assert _same(be, 0, reader, 4, 3)
        server.stop()
        t0 = time.monotonic()
        assert reader.batch_exists(names(3, salt=1)) == 0
        assert reader.batch_get_v1(names(3, salt=1), page_indices(4, 3)) == [False] * 3
        assert be.batch_set_v1(names(2, salt=2), page_indices(0, 2)) in ([False, False], [True, True])
        assert time.monotonic() - t0 < 60  # within the deadline's bound, never a hang
        be.close()
        reader.close()
    finally:
        server.stop()


def test_failure_injector_wraps_kvport(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own HiCacheStorageFailureInjector around kvport: failed calls are misses SGLang handles."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1.0")
    pool = mha_pool("layer_first")
    cfg = storage_config(model_dir, {"kvport_disk_dir": str(tmp_path / "kv")})
    be = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert type(be).__name__ == "HiCacheStorageFailureInjector"
    be.register_mem_pool_host(pool)
    assert be.batch_set_v1(names(2), page_indices(0, 2)) == [False, False]
    assert be.batch_exists(names(2)) == 0 or be.batch_exists(names(2)) == 0
    inner = be._backend
    assert inner.batch_set_v1(names(2), page_indices(0, 2)) == [True, True]
    assert be.batch_get_v1(names(2), page_indices(3, 2)) == [False, False]
    assert inner.batch_get_v1(names(2), page_indices(3, 2)) == [True, True]
    inner.close()


def test_planner_declines_a_hit_slower_than_recompute(model_dir: Path, tmp_path: Path) -> None:
    be = backend(mha_pool("layer_first"), model_dir, {"kvport_disk_dir": str(tmp_path / "kv")})
    assert be.batch_set_v1(names(4), page_indices(0, 4)) == [True] * 4
    now = time.time()
    prefill = PrefillModel(model_id=be.spec.model_id, threads=1, a=0.0, b=1e-3, c=0.0, d=0.0, measured_at=now)

    def planner(bandwidth: float) -> Planner:
        prof = Profile(machine="test", created=now, prefill=prefill,
                       links=(Link("disk", LinkKind.TIER, bandwidth, 0.0, now),))
        return Planner(prof, machine="test")

    be.planner = planner(1e3)  # 1 kB/s: loading 64 tokens takes minutes, recomputing them 64 ms
    assert be.batch_exists(names(4)) == 0 and be.stats["declined"] == 4
    be.planner = planner(100e9)
    assert be.batch_exists(names(4)) == 4
    be.close()
