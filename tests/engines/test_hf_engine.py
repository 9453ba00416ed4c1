"""Prefix reuse in transformers on the reference model: same greedy output, loads only what is safe."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvport.codec import get_codec
from kvport.codec.envelope import BlockFormat, parse, stored_bytes
from kvport.deadline import Deadline
from kvport.engines.hf import HFEngine, Lifetime, StoreBlocks, TierBlocks
from kvport.errors import CodecError, TierUnavailableError
from kvport.spec import DType, KVSpec, from_hf_config
from kvport.store import TieredStore
from kvport.tiers import CodecTier, HostTier, Tier
from tests.codec.conftest import reseal, with_meta

pytestmark = pytest.mark.slow
NEW = 6


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Iterator[object]:
    from kvport.refmodel import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two intra-op threads collapse on a shared 2-core box
    m, _ = load(model_dir)
    yield m
    torch.set_num_threads(threads)


@pytest.fixture()
def tier(model_dir: Path) -> Iterator[HostTier]:
    vb = stored_bytes(from_hf_config(model_dir, dtype=DType.FP32))  # a page holds one sealed block
    t = HostTier(64 * vb, vb)
    yield t
    t.close()


def _engine(model: object, model_dir: Path, tier: Tier | None, **spec_changes: object) -> HFEngine:
    """An engine over a real TieredStore holding ``tier`` (None: generation without kvport)."""
    spec = from_hf_config(model_dir, dtype=DType.FP32).with_(**spec_changes)
    return HFEngine(model, spec, None if tier is None else StoreBlocks(TieredStore([tier]), spec))


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 49_000, n)


def _hf_generate(model: object, prompt: np.ndarray) -> tuple[int, ...]:
    ids = torch.from_numpy(prompt).unsqueeze(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,  # type: ignore[attr-defined]
                         min_new_tokens=NEW)
    return tuple(out[0, len(prompt) :].tolist())


def test_greedy_output_identical_with_and_without_kvport(model: object, model_dir: Path, tier: HostTier) -> None:
    prompt = _prompt(100, 1)
    reference = _hf_generate(model, prompt)  # plain transformers, no kvport anywhere
    eng = _engine(model, model_dir, tier)
    eng.eos = frozenset()
    first = eng.generate(prompt, NEW)
    assert first.tokens == reference and first.cached_tokens == 0 and first.computed_tokens == 100
    assert first.stored_blocks == (100 + NEW - 1) // 16  # prompt and generated tokens, full blocks only
    again = eng.generate(prompt, NEW)
    assert again.tokens == reference
    assert again.cached_tokens == 96 and again.computed_tokens == 4 and again.fallback is None
    assert again.loaded_bytes == 6 * eng.spec.bytes_per_block
    plain = _engine(model, model_dir, None)
    plain.eos = frozenset()
    assert plain.generate(prompt, NEW).tokens == reference


def test_partial_prefix_reuse_and_next_turn_hits_the_answer(model: object, model_dir: Path, tier: HostTier) -> None:
    eng, plain = _engine(model, model_dir, tier), _engine(model, model_dir, None)
    system = _prompt(40, 2)
    turn1 = np.concatenate([system, _prompt(30, 3)])
    r1 = eng.generate(turn1, NEW, shared_prefix_tokens=len(system))
    assert r1.cached_tokens == 0
    other_user = np.concatenate([system, _prompt(25, 4)])
    r2 = eng.generate(other_user, NEW, shared_prefix_tokens=len(system))
    assert r2.cached_tokens == 32  # the system prompt's two full blocks, not the diverging third
    assert r2.tokens == plain.generate(other_user, NEW).tokens
    turn2 = np.concatenate([turn1, np.asarray(r1.tokens), _prompt(20, 5)])
    r3 = eng.generate(turn2, NEW)
    assert r3.cached_tokens == ((len(turn1) + len(r1.tokens) - 1) // 16) * 16  # turn 1 and its answer
    assert r3.tokens == plain.generate(turn2, NEW).tokens


def test_a_save_restores_what_left_the_store_after_its_lookup(model: object, model_dir: Path, tier: HostTier) -> None:
    """A save told to skip the blocks a lookup found starts at the first one that has left since (a
    load found it damaged, it was evicted or deleted), so the chain stays whole and hits again."""
    spec = from_hf_config(model_dir, dtype=DType.FP32)
    store = TieredStore([tier])
    eng = HFEngine(model, spec, StoreBlocks(store, spec))
    eng.eos = frozenset()
    prompt = _prompt(100, 11)
    eng.generate(prompt, NEW, store_output=False)
    keys = eng.keys(prompt[:96])
    assert eng.store.longest_prefix(keys) == 6
    for k in keys[2:]:  # the chain's tail left after a lookup saw all six
        store.delete(k)
    pf = eng.prefill(prompt)  # a fresh prefill: the cache holds the whole prompt
    assert eng.save(prompt, pf.cache, skip_blocks=6, lifetime=Lifetime.SESSION) == 4
    assert eng.store.longest_prefix(keys) == 6
    again = eng.generate(prompt, NEW, store_output=False)
    assert again.cached_tokens == 96 and again.fallback is None


class _Recorder:
    def __init__(self, inner: StoreBlocks) -> None:
        self.inner = inner
        self.writes: list[tuple[int, Lifetime]] = []

    def longest_prefix(self, keys: Sequence[bytes], *, deadline: Deadline | None = None) -> int:
        return self.inner.longest_prefix(keys, deadline=deadline)

    def read_into(self, keys: Sequence[bytes], out: torch.Tensor, *, deadline: Deadline | None = None) -> None:
        self.inner.read_into(keys, out, deadline=deadline)

    def write(self, keys: Sequence[bytes], blocks: torch.Tensor, lifetime: Lifetime,
              parent: bytes | None = None) -> None:
        self.writes.append((len(keys), lifetime))
        self.inner.write(keys, blocks, lifetime, parent)


def test_shared_system_prompt_blocks_are_stored_as_prefix(model: object, model_dir: Path, tier: HostTier) -> None:
    eng = _engine(model, model_dir, tier)
    assert isinstance(eng.store, StoreBlocks)
    store = eng.store.store
    rec = _Recorder(eng.store)
    eng.store = rec
    prompt = _prompt(70, 6)
    eng.generate(prompt, 3, shared_prefix_tokens=40, lifetime=Lifetime.SESSION)
    assert rec.writes == [(2, Lifetime.PREFIX), (2, Lifetime.SESSION)]  # 72 tokens in cache: 4 full blocks
    keys = eng.keys(np.concatenate([prompt, [0, 0]]))
    assert [store.lifetime_of(k) for k in keys] == [Lifetime.PREFIX] * 2 + [Lifetime.SESSION] * 2


def test_incompatible_stored_prefix_is_never_loaded(model: object, model_dir: Path, tier: HostTier) -> None:
    prompt = _prompt(80, 7)
    other = _engine(model, model_dir, tier, revision="another-revision")
    other.generate(prompt, 2)  # blocks of another revision now sit in the shared tier
    assert len(list(tier.keys())) == 5
    eng = _engine(model, model_dir, tier)
    r = eng.generate(prompt, NEW)
    assert r.cached_tokens == 0 and r.fallback is None  # different fingerprint -> different keys: a miss
    # bytes of another layout planted under this model's own keys (a bare tier, no store index):
    # refused when read, the request recomputes with the same output
    raw = TierBlocks(tier, eng.spec)
    for key in eng.keys(prompt)[:4]:
        tier.put(key, b"\0" * (eng.spec.bytes_per_block // 2))
    eng.store = raw
    r2 = eng.generate(prompt, NEW)
    assert r2.cached_tokens == 0 and r2.fallback is not None and "CorruptBlockError" in r2.fallback
    assert r2.tokens == r.tokens == _engine(model, model_dir, None).generate(prompt, NEW).tokens


class _FailingTier(Tier):
    """Delegates to a real tier; ``get_into`` / ``view`` fail once ``reads_left`` reads were served (None: never)."""

    def __init__(self, inner: HostTier, reads_left: int | None) -> None:
        self.inner, self.reads_left = inner, reads_left
        self.name, self.caps = "failing", replace(inner.caps, zero_copy_write=False)  # no reserve_views here

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def put(self, key: bytes, data: object, *, ttl_s: float | None = None) -> None:
        self.inner.put(key, data, ttl_s=ttl_s)  # type: ignore[arg-type]

    def _read(self) -> None:
        if self.reads_left is not None:
            if self.reads_left <= 0:
                raise TierUnavailableError("injected: tier went away mid-load")
            self.reads_left -= 1

    def get_into(self, key: bytes, dst: object) -> int:
        self._read()
        return self.inner.get_into(key, dst)  # type: ignore[arg-type]

    def view(self, key: bytes) -> memoryview:  # the store's zero-copy read path fails the same way
        self._read()
        return self.inner.view(key)

    def size_of(self, key: bytes) -> int | None:
        return self.inner.size_of(key)

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()


def test_tier_failing_mid_load_recomputes_with_same_output(model: object, model_dir: Path, tier: HostTier) -> None:
    prompt = _prompt(90, 8)
    failing = _FailingTier(tier, reads_left=None)
    eng = _engine(model, model_dir, failing)
    good = eng.generate(prompt, NEW)
    failing.reads_left = 2
    r = eng.generate(prompt, NEW)
    assert failing.reads_left == 0  # two blocks were read before the failure
    assert r.cached_tokens == 0 and r.computed_tokens == 90 and r.fallback is not None
    assert r.tokens == good.tokens
    # the same fault straight from a bare tier (no store in between) names the tier's own error
    bare = HostTier(16 * stored_bytes(eng.spec), stored_bytes(eng.spec))
    eng.store = TierBlocks(bare, eng.spec)
    assert eng.generate(prompt, NEW).stored_blocks == 5
    eng.store = TierBlocks(_FailingTier(bare, reads_left=1), eng.spec)
    r2 = eng.generate(prompt, NEW)
    assert r2.fallback is not None and "TierUnavailableError" in r2.fallback and r2.tokens == good.tokens


def _planner(model_dir: Path, tier_bandwidth: float) -> object:
    """A planner whose profile says the store tier moves ``tier_bandwidth`` bytes/s and prefill costs 1 ms/token."""
    import time as _time

    from kvport.planner import Link, LinkKind, Planner, PrefillModel, Profile

    spec = from_hf_config(model_dir, dtype=DType.FP32)
    now = _time.time()
    prefill = PrefillModel(model_id=spec.model_id, threads=1, a=0.0, b=1e-3, c=0.0, d=0.0, measured_at=now)
    prof = Profile(machine="test", created=now, prefill=prefill,
                   links=(Link("store", LinkKind.TIER, tier_bandwidth, 0.0, now),))
    return Planner(prof, machine="test")


@pytest.mark.parametrize(("bandwidth", "expect_load"), [(1e3, False), (1e12, True)])
def test_engine_asks_the_planner_before_loading(model: object, model_dir: Path, tier: HostTier,
                                                bandwidth: float, expect_load: bool) -> None:
    prompt = _prompt(100, 5)
    reference = _engine(model, model_dir, None).generate(prompt, NEW).tokens
    spec = from_hf_config(model_dir, dtype=DType.FP32)
    store = StoreBlocks(TieredStore([tier]), spec)
    HFEngine(model, spec, store).generate(prompt, NEW)  # stores the prompt's blocks
    eng = HFEngine(model, spec, store, planner=_planner(model_dir, bandwidth))  # type: ignore[arg-type]
    res = eng.generate(prompt, NEW, store_output=False)
    assert res.tokens == reference  # same greedy output whichever way the planner goes
    if expect_load:
        assert res.cached_tokens > 0 and res.fallback is None
    else:  # a 1 kB/s link: recompute is far cheaper, nothing is loaded and the reason is recorded
        assert res.cached_tokens == 0 and res.fallback is not None and res.fallback.startswith("planner:")


def _other_rank(spec: object, value: bytes, key: bytes) -> bytes:
    """The same block bytes, sealed by rank 1 of a TP-2 engine whose per-rank shape is this one's."""
    assert isinstance(spec, KVSpec)
    other = BlockFormat(spec.with_(num_kv_heads=2 * spec.num_kv_heads, tp_size=2, tp_rank=1))
    out = bytearray(value)
    other.seal(out, key)
    return bytes(out)


def _swapped_part(spec: object, value: bytes, donor: bytes) -> bytes:
    """``value`` with the K part of layer 7 from ``donor`` (same place, same length, a valid K part)."""
    assert isinstance(spec, KVSpec)
    fmt = BlockFormat(spec)
    p = fmt.parts[14]
    a, b = fmt.header_len + p.offset, fmt.header_len + p.offset + p.length
    return value[:a] + donor[a:b] + value[b:]


def _without_last_v(spec: object, value: bytes, key: bytes) -> bytes:
    """The block with its last layer's V part gone, the envelope written to match (not bit rot)."""
    assert isinstance(spec, KVSpec)
    env = parse(value)
    body = value[env.header_len : env.header_len + env.parts[-1].offset]
    return reseal(value, body, [(p.kind, p.layer, p.sub, p.length) for p in env.parts[:-1]])


@pytest.mark.parametrize("damage", ["other_rank", "v_part_missing", "part_swapped", "no_envelope"])
def test_a_refused_block_is_recomputed_with_the_same_output(model: object, model_dir: Path, tier: HostTier,
                                                            damage: str) -> None:
    prompt = _prompt(100, 11)
    reference = _engine(model, model_dir, None).generate(prompt, NEW).tokens
    eng = _engine(model, model_dir, tier)
    assert eng.generate(prompt, NEW).tokens == reference  # stores the prompt's blocks
    keys = eng.keys(prompt[:96])
    value, donor = tier.get(keys[2]), tier.get(keys[3])
    bad = {"other_rank": lambda: _other_rank(eng.spec, value, keys[2]),
           "v_part_missing": lambda: _without_last_v(eng.spec, value, keys[2]),
           "part_swapped": lambda: _swapped_part(eng.spec, value, donor),
           "no_envelope": lambda: value[BlockFormat(eng.spec).header_len :]}[damage]()
    tier.put(keys[2], bad)  # under the store, into the page the store's index points at
    r = eng.generate(prompt, NEW)
    assert r.tokens == reference  # same greedy output as without kvport
    assert r.cached_tokens == 0 and r.fallback is not None and "block" in r.fallback  # nothing linked
    assert isinstance(eng.store, StoreBlocks) and isinstance(eng.store.last_refusal, CodecError)
    again = eng.generate(prompt, NEW)  # the recomputed blocks were stored again: a clean hit
    assert again.cached_tokens == 96 and again.fallback is None and again.tokens == reference


@pytest.mark.parametrize("damage", ["scales_missing", "no_params", "params_of_another_codec"])
def test_a_refused_codec_frame_is_recomputed_with_the_same_output(model: object, model_dir: Path,
                                                                  damage: str) -> None:
    spec = from_hf_config(model_dir, dtype=DType.FP32)
    inner = HostTier(64 << 20, 1 << 20)  # pages of 1 MiB: any frame of a block fits
    codec_tier = CodecTier(inner, get_codec("lossless"), spec)
    eng = HFEngine(model, spec, StoreBlocks(TieredStore([codec_tier]), spec))
    prompt = _prompt(100, 12)
    reference = _engine(model, model_dir, None).generate(prompt, NEW).tokens
    eng.generate(prompt, NEW)
    good = eng.generate(prompt, NEW)  # decoded from lossless frames: exact
    assert good.cached_tokens == 96 and good.tokens == reference
    key = eng.keys(prompt[:96])[1]
    frame = inner.get(key)
    env = parse(frame)
    kinds = [(p.kind, p.layer, p.sub, p.length) for p in env.parts]
    body = frame[env.header_len :]
    bad = {"scales_missing": lambda: reseal(frame, body[: env.parts[-1].offset], kinds[:-1]),
           "no_params": lambda: reseal(frame, body[env.parts[0].length :], kinds[1:]),
           "params_of_another_codec": lambda: with_meta(frame, {"id": "int8", "params": {}})}[damage]()
    inner.put(key, bad)
    r = eng.generate(prompt, NEW)
    assert r.tokens == reference and r.cached_tokens == 0 and r.fallback is not None
    assert not inner.contains(key) or inner.get(key) != bad  # the bad frame was dropped


def test_a_rank_spec_is_refused_for_a_model_that_is_not_sharded(model: object, model_dir: Path) -> None:
    """A spec of rank 1 of 3 over a whole model would cache 3 heads as 1: refused, naming both."""
    from kvport.errors import EngineError

    spec = from_hf_config(model_dir, dtype=DType.FP32).for_rank(1, 3)
    with pytest.raises(EngineError, match=r"rank 1 of tp_size 3; the model runs as rank 0 of 1"):
        HFEngine(model, spec)
