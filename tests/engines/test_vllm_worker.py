"""KVPortConnector's data path against a real DiskTier: paged KV -> disk -> another engine's paged KV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvport.client.port import StoreConfig, open_store
from kvport.codec.envelope import BlockFormat, parse, stored_bytes
from kvport.engines.vllm.config import ConnectorConfig
from kvport.engines.vllm.identity import check_expected, engine_spec
from kvport.engines.vllm.paged import PagedKV
from kvport.engines.vllm.plan import BlockCopy
from kvport.engines.vllm.worker import BlockMover
from kvport.errors import ConfigError, EngineError, IncompatibleSpecError
from kvport.keys import KeyContext, chain_keys
from kvport.spec import DType, KVSpec, Layout
from kvport.store import TieredStore
from kvport.tiers.disk import DiskTier

SPEC = KVSpec("m", num_layers=3, num_kv_heads=2, head_dim=8, dtype=DType.FP32, block_size=4, layout=Layout.VLLM_CPU)
CTX = KeyContext(block_size=4, spec_fingerprint=SPEC.fingerprint)


def engine_kv(num_blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn(num_blocks, 2, 4, 16, generator=g)) if seed is not None else (
        lambda: torch.zeros(num_blocks, 2, 4, 16))
    # registered in a scrambled order: layer order comes from the names
    return {f"model.layers.{i}.self_attn.attn": make() for i in (2, 0, 1)}


def store(tmp_path: Path) -> TieredStore:
    """The connector's store: a disk folder shared with other engine processes, through the port."""
    return open_store(StoreConfig(block_bytes=stored_bytes(SPEC), disk_dir=tmp_path / "disk", disk_bytes=1 << 30,
                                  disk_shared=True))


def mover(tmp_path: Path, kv: dict[str, torch.Tensor], staging: int = 8) -> BlockMover:
    return BlockMover(SPEC, store(tmp_path), PagedKV(kv, SPEC), staging)


def layer(kv: dict[str, torch.Tensor], i: int) -> torch.Tensor:
    return kv[f"model.layers.{i}.self_attn.attn"]


def saved_prefix(tmp_path: Path, n_blocks: int) -> tuple[dict[str, torch.Tensor], list[bytes], list[int]]:
    src = engine_kv(16, seed=1)
    keys = chain_keys(list(range(n_blocks * 4)), CTX)
    src_ids = [9, 2, 14, 5, 11, 0][:n_blocks]
    m = mover(tmp_path, src)
    m.save([BlockCopy("a", tuple(keys), tuple(src_ids))])
    assert m.stats.blocks_saved == n_blocks
    return src, keys, src_ids


@pytest.mark.parametrize("staging", [8, 2])  # layer-by-layer, and eager waves when staging is small
def test_blocks_saved_by_one_engine_load_into_other_block_ids_of_another(tmp_path: Path, staging: int) -> None:
    src, keys, src_ids = saved_prefix(tmp_path, 5)
    dst = engine_kv(12, seed=None)
    m = mover(tmp_path, dst, staging)  # a fresh tier instance: index rebuilt from the folder
    dst_ids = [3, 7, 1, 10, 4]
    m.begin_load([BlockCopy("b", tuple(keys), tuple(dst_ids))])
    for i in range(SPEC.num_layers):  # the engine asks layer by layer
        m.load_layer(i)
    m.finish_load()
    for i in range(SPEC.num_layers):
        assert torch.equal(layer(dst, i)[dst_ids], layer(src, i)[src_ids])
        untouched = [b for b in range(12) if b not in dst_ids]
        assert not layer(dst, i)[untouched].any()
    assert m.take_failed() == set() and m.stats.blocks_loaded == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the GPU check runs this)")
def test_on_cuda_the_next_layer_is_copied_ahead_while_this_one_computes_and_equals_the_cpu_load(
        tmp_path: Path) -> None:
    src, keys, src_ids = saved_prefix(tmp_path, 5)
    dst = {n: t.cuda() for n, t in engine_kv(12, seed=None).items()}
    m = BlockMover(SPEC, store(tmp_path), PagedKV(dst, SPEC), 8)
    dst_ids = [3, 7, 1, 10, 4]
    m.begin_load([BlockCopy("b", tuple(keys), tuple(dst_ids))])
    for i in range(SPEC.num_layers):
        m.load_layer(i)
        assert (i + 1 in m._ahead) == (i + 1 < SPEC.num_layers)  # queued on the side stream, not waited for
    m.finish_load()  # every queued copy out of the pinned staging before it is reused
    torch.cuda.synchronize()
    for i in range(SPEC.num_layers):
        assert torch.equal(layer(dst, i).cpu()[dst_ids], layer(src, i)[src_ids])
    assert m.take_failed() == set()


def test_a_layer_the_engine_never_waited_for_is_still_loaded_before_the_step_ends(tmp_path: Path) -> None:
    src, keys, src_ids = saved_prefix(tmp_path, 2)
    dst = engine_kv(4, seed=None)
    m = mover(tmp_path, dst)
    m.begin_load([BlockCopy("b", tuple(keys), (0, 1))])
    m.load_layer(1)
    m.finish_load()
    for i in range(SPEC.num_layers):
        assert torch.equal(layer(dst, i)[[0, 1]], layer(src, i)[src_ids])


def test_a_corrupt_block_fails_the_rest_of_that_load_and_is_reported(tmp_path: Path) -> None:
    src, keys, src_ids = saved_prefix(tmp_path, 4)
    path, offset, length = DiskTier(tmp_path / "disk", 1 << 30).locate(keys[2])
    raw = bytearray(path.read_bytes())
    raw[offset + length // 2] ^= 0xFF  # flip one payload byte: the size is intact, the checksum is not
    path.write_bytes(bytes(raw))
    dst = engine_kv(8, seed=None)
    m = mover(tmp_path, dst)
    m.begin_load([BlockCopy("b", tuple(keys), (4, 5, 6, 7))])
    m.finish_load()
    # blocks 0 and 1 loaded; from the corrupt block on, vLLM must recompute
    assert m.take_failed() == {6, 7}
    assert m.take_failed() == set()  # reported once
    for i in range(SPEC.num_layers):
        assert torch.equal(layer(dst, i)[[4, 5]], layer(src, i)[src_ids[:2]])
        assert not layer(dst, i)[[6, 7]].any()  # never wrong data
    assert m.stats.blocks_failed == 2
    assert not m.store.contains(keys[2])  # the store dropped it: next lookup is a clean miss


def test_a_block_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "disk", 1 << 30)
    key = chain_keys([1, 2, 3, 4], CTX)[0]
    tier.put(key, b"\x00" * (SPEC.bytes_per_block - 4))
    dst = engine_kv(2, seed=None)
    m = BlockMover(SPEC, store(tmp_path), PagedKV(dst, SPEC), 2)
    m.begin_load([BlockCopy("b", (key,), (1,))])
    assert m.take_failed() == {1}


def _planted_load(tmp_path: Path, value: bytes,
                  key_index: int = 2) -> tuple[BlockMover, list[bytes], dict[str, torch.Tensor]]:
    """Four blocks saved, then ``value`` written under key ``key_index`` by another writer of the folder;
    a fresh engine loads all four into block ids 4..7."""
    saved_prefix(tmp_path, 4)
    keys = chain_keys(list(range(16)), CTX)
    DiskTier(tmp_path / "disk", 1 << 30).put(keys[key_index], value)
    dst = engine_kv(8, seed=None)
    m = mover(tmp_path, dst)
    m.begin_load([BlockCopy("b", tuple(keys[:4]), (4, 5, 6, 7))])
    m.finish_load()
    return m, keys, dst


def _stored(tmp_path: Path, i: int) -> bytes:
    keys = chain_keys(list(range(16)), CTX)
    out = bytearray(stored_bytes(SPEC))
    assert store(tmp_path).get_into(keys[i], out) == len(out)
    return bytes(out)


def _refused_from_block_2(m: BlockMover, keys: list[bytes], dst: dict[str, torch.Tensor],
                          by_envelope: int = 1) -> None:
    assert m.take_failed() == {6, 7}  # reported: vLLM recomputes them
    assert m.stats.blocks_refused == by_envelope  # (a value of the wrong length never gets that far)
    for i in range(SPEC.num_layers):
        assert not layer(dst, i)[[6, 7]].any()  # nothing of the refused block (or after it) was linked
        assert layer(dst, i)[[4, 5]].any()
    assert not m.store.contains(keys[2])  # deleted: the next lookup is a clean miss


def test_a_block_of_another_rank_under_the_right_key_is_refused(tmp_path: Path) -> None:
    saved_prefix(tmp_path, 4)
    value = bytearray(_stored(tmp_path, 2))
    other = SPEC.with_(num_kv_heads=4, tp_size=2, tp_rank=1)  # the same slab shape: rank 1's two heads
    keys = chain_keys(list(range(16)), CTX)
    BlockFormat(other).seal(value, keys[2])
    m, keys, dst = _planted_load(tmp_path / "x", bytes(value))
    _refused_from_block_2(m, keys, dst)


def test_a_block_missing_a_layers_part_or_with_a_part_of_another_block_is_refused(tmp_path: Path) -> None:
    from tests.codec.conftest import reseal

    saved_prefix(tmp_path, 4)
    value, donor = _stored(tmp_path, 2), _stored(tmp_path, 3)
    env = parse(value)
    last = env.parts[-1]  # layer 2's slab
    kinds = [(p.kind, p.layer, p.sub, p.length) for p in env.parts[:-1]]
    short = reseal(value, value[env.header_len : env.header_len + last.offset], kinds)
    m, keys, dst = _planted_load(tmp_path / "short", short)
    _refused_from_block_2(m, keys, dst, by_envelope=0)
    p1 = env.parts[1]  # layer 1's slab, taken from block 3: a valid slab, the wrong one
    a, b = env.header_len + p1.offset, env.header_len + p1.offset + p1.length
    m, keys, dst = _planted_load(tmp_path / "swapped", value[:a] + donor[a:b] + value[b:])
    _refused_from_block_2(m, keys, dst)


def test_an_old_block_without_envelope_is_a_load_error(tmp_path: Path) -> None:
    m, keys, dst = _planted_load(tmp_path, b"\x01" * SPEC.bytes_per_block)  # what kvport stored before
    _refused_from_block_2(m, keys, dst, by_envelope=0)


def test_paged_kv_refuses_a_layout_it_does_not_know() -> None:
    gpu_like = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 6, 4, 2, 8) for i in range(3)}
    with pytest.raises(EngineError, match="CPU layout"):
        PagedKV(gpu_like, SPEC)
    with pytest.raises(EngineError, match="layers"):
        PagedKV({"model.layers.0.self_attn.attn": torch.zeros(2, 2, 4, 16)}, SPEC)
    bf16 = {k: v.to(torch.bfloat16) for k, v in engine_kv(2, seed=None).items()}
    with pytest.raises(EngineError, match="bfloat16"):
        PagedKV(bf16, SPEC)


def test_config_from_extra_config() -> None:
    cfg = ConnectorConfig.from_extra_config({"kvport_disk_dir": "/x", "kvport_disk_capacity": "2 GiB",
                                             "kvport_tenant_salt": "ab01", "other_connector_key": 1})
    assert cfg.disk_capacity_bytes == 2 * 1024**3 and cfg.tenant_salt == b"\xab\x01"
    for bad in ({}, {"kvport_disk_dir": "/x", "kvport_disk_dir_typo": 1},
                {"kvport_disk_dir": "/x", "kvport_disk_capacity": "lots"},
                {"kvport_disk_dir": "/x", "kvport_staging_tokens": 0},
                {"kvport_disk_dir": "/x", "kvport_tenant_salt": "xyz"},
                {"kvport_redis": "http://x:1"}, {"kvport_redis": 5},
                {"kvport_redis": "redis://x:1/0?cluster=maybe"}, {"kvport_redis": "redis://x:1/0?wait_replicas=a"}):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra_config(bad)
    only_redis = ConnectorConfig.from_extra_config({"kvport_redis": "redis://h:7000/0?cluster=true"})
    assert only_redis.redis_url == "redis://h:7000/0?cluster=true" and only_redis.disk_dir is None


def test_engine_spec_names_config_weights_and_revision(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "a" / "model.safetensors").write_bytes(b"weights-1" * 100)
    (tmp_path / "b" / "model.safetensors").write_bytes(b"weights-2" * 100)
    a = engine_spec(str(tmp_path / "a"), dtype="torch.float32", block_size=32)
    b = engine_spec(str(tmp_path / "b"), dtype="torch.float32", block_size=32)
    a2 = engine_spec(str(tmp_path / "a"), dtype="torch.float32", block_size=32, revision="v2")
    assert a.layout is Layout.VLLM_CPU and a.dtype is DType.FP32 and a.head_dim == 16
    assert len({a.fingerprint, b.fingerprint, a2.fingerprint}) == 3  # fine-tune, operator revision
    assert engine_spec(str(tmp_path / "a"), dtype="float32", block_size=32).fingerprint == a.fingerprint
    check_expected(a, a)
    with pytest.raises(IncompatibleSpecError) as err:
        check_expected(a, a.with_(block_size=16))
    assert err.value.field == "block_size"
    with pytest.raises(EngineError):
        engine_spec("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32", block_size=32)


def test_a_load_that_cannot_start_by_its_deadline_is_reported_and_recomputed(tmp_path: Path) -> None:
    import threading

    from kvport.deadline import DeadlinePolicy

    src = engine_kv(16, seed=1)
    keys = chain_keys(list(range(2 * 4)), CTX)
    m = mover(tmp_path, src)
    m.save([BlockCopy("a", tuple(keys), (9, 2))])
    dst = engine_kv(8, seed=None)
    slow = BlockMover(SPEC, store(tmp_path), PagedKV(dst, SPEC), 8, DeadlinePolicy(min_s=0.2, factor=1.0, max_s=0.3))
    held, done = threading.Event(), threading.Event()

    def hog() -> None:
        with slow.store.holding():  # the store is busy (a long save, say) past the load's deadline
            held.set()
            done.wait(10)

    t = threading.Thread(target=hog)
    t.start()
    held.wait(5)
    try:
        slow.begin_load([BlockCopy("b", tuple(keys), (4, 5))])
        slow.finish_load()
    finally:
        done.set()
        t.join()
    assert slow.take_failed() == {4, 5}  # vLLM recomputes them; nothing was linked
    for i in range(SPEC.num_layers):
        assert not layer(dst, i)[[4, 5]].any()


def test_connector_config_reaches_a_kvport_server_and_checks_its_new_keys() -> None:
    cfg = ConnectorConfig.from_extra_config({"kvport_server": "127.0.0.1:7070", "kvport_server_tenant": "a",
                                             "kvport_host_capacity": "64 MiB", "kvport_pd_lease_s": 5})
    assert cfg.disk_dir is None and cfg.server == ("127.0.0.1", 7070) and cfg.server_tenant == "a"
    assert cfg.host_capacity_bytes == 64 << 20 and cfg.pd_lease_s == 5.0 and cfg.save_generated
    assert cfg.server_write_behind and cfg.idle_spin_s is None  # defaults: write-behind, vLLM's own spin
    cfg = ConnectorConfig.from_extra_config({"kvport_server": "h:1", "kvport_server_write": "through",
                                             "kvport_idle_spin_ms": 5})
    assert not cfg.server_write_behind and cfg.idle_spin_s == 0.005
    h = {"kvport_server": "h:1"}
    for bad in ({"kvport_server": "nohost"}, {"kvport_server": "h:99999"}, {**h, "kvport_pd_lease_s": 0},
                {**h, "kvport_save_generated": "yes"}, {**h, "kvport_server_tenant": ""},
                {**h, "kvport_async_handoff": 1}, {"kvport_host_capacity": "1 GiB"},
                {**h, "kvport_server_write": "later"}, {**h, "kvport_idle_spin_ms": -1},
                {**h, "kvport_idle_spin_ms": True}):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra_config(bad)
