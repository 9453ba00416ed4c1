"""Greedy generation with prefix reuse for Llama-style causal LMs in transformers 5.x.

One request::

    prompt ids --chain_keys--> keys[0..P)          P = (len(prompt) - 1) // B  (>= 1 token is prefilled)
    store.longest_prefix(keys) = h                 load blocks 0..h into staging, one gather into landing
    a cache over the landing buffer                (no copy; reserved for the whole prompt plus the decode
                                                   room, so the model appends in place: engines.hf.cache)
    forward(prompt[h*B:]) -> first token           only the uncached tokens are computed (GQA attention
                                                   without K/V expansion: engines.hf.cache)
    decode loop (one token per forward)            greedy, stops at EOS or max_new_tokens
    scatter the new full blocks -> store.write     blocks inside the shared prefix: Lifetime.PREFIX,
                                                   the rest: the request's lifetime (SESSION for chats)

Invariants:
- Output equals the same loop with no store, bit for bit: the prefix KV of a causal LM does not depend
  on later tokens, and the suffix forward reads exactly the K/V a full prefill would have produced
  (checked by tests against ``model.generate``).
- A failed, corrupt or incompatible load never reaches the model: any kvport error during lookup or
  read drops the whole loaded prefix and the request recomputes from token 0 (``fallback`` says why).
  Blocks of another model/revision/dtype/layout cannot even be looked up: every key chains from the
  spec fingerprint (:mod:`kvport.keys`); and every stored block carries its envelope (identity, key,
  a manifest of its K and V parts, each part's xxh3: :mod:`kvport.codec.envelope`), checked before a
  byte of it is copied, so bytes of another rank, head range or block, a part missing or damaged, or
  an old block without envelope are refused too.
- A failed store write is recorded (``store_error``) and never fails the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvport import metrics
from kvport.deadline import Deadline, DeadlinePolicy
from kvport.deadline import current as current_deadline
from kvport.engines.hf.layout import BlockLayout, cache_layers
from kvport.engines.hf.port import BlockStore, Lifetime
from kvport.errors import EngineError, KVPortError
from kvport.keys import BlockKey, KeyContext, as_token_array, chain_keys, head_keys
from kvport.planner import Action, Cached, LinkKind, Planner, Request
from kvport.spec import DType, KVSpec, from_hf_config

log = logging.getLogger(__name__)

_TOKENS = metrics.counter("hf_prompt_tokens", "prompt tokens seen by the transformers adapter", ["source"])
_FALLBACKS = metrics.counter("hf_load_fallbacks", "loads abandoned for a recompute", ["error"])


def tp_of(model: Any) -> tuple[int, int]:
    """(tp_size, tp_rank) a transformers model runs as: (1, 0) unless it was loaded with a
    ``tp_plan`` over a process group (each rank then computes, and caches, its KV heads only)."""
    size = int(getattr(model, "tp_size", None) or 1)
    if size == 1:
        return 1, 0
    mesh = getattr(model, "device_mesh", None)
    if mesh is not None:
        return size, int(mesh.get_local_rank())
    import torch.distributed as dist

    return size, int(dist.get_rank())


@dataclass(frozen=True, slots=True)
class GenerationResult:
    tokens: tuple[int, ...]  # generated ids (EOS included when produced)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was loaded from the store
    computed_tokens: int  # prompt tokens prefilled by the model
    ttft_s: float  # from the call to the first generated token (keys, lookup, load, prefill)
    total_s: float
    loaded_bytes: int
    stored_blocks: int
    fallback: str | None = None  # why a load was dropped (the request recomputed), None if it was not
    store_error: str | None = None  # why storing the new blocks failed, None if it did not


@dataclass(frozen=True, slots=True)
class Loaded:
    """What :meth:`HFEngine.load` found: ``blocks`` leading blocks now held by ``cache`` (None when 0)."""

    blocks: int
    cache: Any
    fallback: str | None = None  # why a failed load was dropped (the caller recomputes)


@dataclass(slots=True)
class Prefill:
    """The state after the prompt: a cache holding the prompt's KV and the first generated token."""

    cache: Any
    first_token: int
    prompt: np.ndarray  # int64 ids
    cached_blocks: int
    loaded_bytes: int
    fallback: str | None
    seconds: float


class HFEngine:
    """Prefix-reusing greedy generation over one model, one spec and (optionally) one store.

    ``store=None`` is generation without kvport: the same loop, nothing looked up or stored.
    """

    def __init__(self, model: Any, spec: KVSpec, store: BlockStore | None = None, *,
                 key_ctx: KeyContext | None = None, eos_token_ids: Sequence[int] | None = None,
                 planner: Planner | None = None, tier_name: str = "store", gqa_attention: bool = True,
                 prefetch_weights: bool = False, deadlines: DeadlinePolicy | None = None) -> None:
        """``gqa_attention``: switch a CPU model on stock ``sdpa`` to kvport's grouped-query variant
        (:func:`kvport.engines.hf.cache.use_gqa_attention`; same outputs, no K/V expansion under a mask)
        and lay its decoder's linear weights out as ``[in, out]`` in memory
        (:func:`kvport.engines.hf.weights.transpose_linear_weights`; bit-identical results, faster;
        not for a model sharded by a ``tp_plan``, whose weights are DTensors).
        ``prefetch_weights``: read the next layer's weights on a spare core during each forward
        (:mod:`kvport.engines.hf.prefetch`; same outputs; worth it only when the process computes on
        fewer cores than it may use). Both change ``model`` itself, so every user of the model (a
        baseline too) runs the same way. ``deadlines``: how long a load may take (factor x the
        planner's expected load time, within bounds; the policy's maximum without a planner); a load
        past it is a miss and the request recomputes."""
        cfg = model.config.get_text_config(decoder=True)
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        got = (cfg.num_hidden_layers, n_kv, head_dim)
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != got:
            raise EngineError(f"spec {spec.model_id} (layers, kv heads, head dim) = "
                              f"{(spec.num_layers, spec.num_kv_heads, spec.head_dim)} does not match the "
                              f"model's {got}")
        tp = tp_of(model)
        if (spec.tp_size, spec.tp_rank) != tp:
            raise EngineError(f"spec {spec.model_id} is rank {spec.tp_rank} of tp_size {spec.tp_size}; the model "
                              f"runs as rank {tp[1]} of {tp[0]} (transformers' tp_plan)")
        self.model = model
        self.spec = spec
        self.store = store
        self.planner = planner  # asked before every load; None = always load what is cached
        self.deadlines = deadlines or DeadlinePolicy()
        self.tier_name = tier_name  # the planner profile's link/tier name for ``store``
        self.layout = BlockLayout(spec)
        if next(model.parameters()).dtype != self.layout.dtype:
            raise EngineError(f"model dtype {next(model.parameters()).dtype} != spec dtype {spec.dtype.value}")
        # keys chain from the model at TP width 1; a rank's blocks are then keyed by its heads (keys.head_keys)
        self.key_ctx = key_ctx or KeyContext(block_size=spec.block_size, spec_fingerprint=spec.whole.fingerprint)
        if self.key_ctx.block_size != spec.block_size or self.key_ctx.spec_fingerprint != spec.whole.fingerprint:
            raise EngineError("key context does not match the spec (block size, or the fingerprint of spec.whole)")
        if eos_token_ids is None:
            eos = getattr(model.generation_config, "eos_token_id", None) or getattr(cfg, "eos_token_id", None)
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self._one = torch.zeros((1, 1), dtype=torch.long)
        if gqa_attention:
            from kvport.engines.hf.cache import use_gqa_attention

            use_gqa_attention(model)
        if gqa_attention and next(model.parameters()).device.type == "cpu" and spec.tp_size == 1:
            from kvport.engines.hf.weights import transpose_linear_weights

            transpose_linear_weights(model)
        if prefetch_weights:
            from kvport.engines.hf.prefetch import weight_prefetch

            weight_prefetch(model)

    @classmethod
    def from_model_dir(cls, model_dir: Path, store: BlockStore | None = None, *, tp_plan: bool = False,
                       **kw: Any) -> HFEngine:
        """Load the model fp32 from an HF folder; spec from its config.json (dtype fp32).

        ``tp_plan``: shard it over the process group this process is a rank of (transformers'
        ``tp_plan="auto"``; on a CPU over gloo, set up from ``RANK`` / ``WORLD_SIZE`` /
        ``MASTER_ADDR`` / ``MASTER_PORT``): the spec is then this rank's, its KV heads only."""
        from transformers import AutoModelForCausalLM

        extra = {"tp_plan": "auto"} if tp_plan else {}
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **extra).eval()
        size, rank = tp_of(model)
        return cls(model, from_hf_config(model_dir, dtype=DType.FP32).for_rank(rank, size), store, **kw)

    # ------------------------------------------------------------------ pieces
    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[BlockKey]:
        """The blocks' keys of this rank's heads (every head at TP width 1)."""
        return head_keys(chain_keys(tokens, self.key_ctx), *self.spec.head_range, self.spec.num_kv_heads,
                         self.key_ctx.algo)

    def _forward(self, ids: torch.Tensor, cache: Any, logprobs: list[float] | None = None) -> int:
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        token = int(logits.argmax())
        if logprobs is not None:  # the chosen token's log-softmax (fp32): what `kvport bench faults` compares
            logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
        return token

    def load(self, keys: Sequence[BlockKey], prompt_tokens: int | None = None) -> Loaded:
        """The longest stored prefix of ``keys``, gathered into a fresh ``DynamicCache``.

        With a planner, the planner is asked first (``prompt_tokens`` long prompt, the hit cached in
        ``tier_name``); when it says recompute, nothing is loaded and the reason is the fallback. Split is
        run as load here (the engine computes the uncached rest either way).

        Under tensor parallelism every rank loads its own heads and the ranks then agree on the
        shortest prefix any of them holds (one all-reduce): a rank whose load missed or failed makes
        the others compute the same tokens, so the group's forward stays one forward."""
        loaded = self._load_own(keys, prompt_tokens)
        if self.spec.tp_size == 1:
            return loaded
        import torch.distributed as dist

        agreed = torch.tensor([loaded.blocks], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        n = int(agreed[0])
        if n == loaded.blocks:
            return loaded
        why = loaded.fallback or f"another rank holds {n} of these {loaded.blocks} blocks"
        return Loaded(n, self.layout.cache(self.model.config, n) if n else None, why)

    def _load_own(self, keys: Sequence[BlockKey], prompt_tokens: int | None) -> Loaded:
        if self.store is None or not keys:
            return Loaded(0, None)
        try:
            hit = min(self.store.longest_prefix(keys, deadline=Deadline.after(self.deadlines.max_s)), len(keys))
            if hit <= 0:
                return Loaded(0, None)
            expected: float | None = None
            if self.planner is not None:
                bs = self.spec.block_size
                req = Request(prompt_tokens=max(prompt_tokens or 0, hit * bs + 1), spec=self.spec,
                              cached=(Cached(self.tier_name, hit * bs),))
                decision = self.planner.decide(req)
                if decision.action is Action.RECOMPUTE:
                    return Loaded(0, None, f"planner: {decision.reason}")
                expected = decision.choice.seconds
            deadline = self.deadlines.for_expected(expected)
            t0 = time.perf_counter()
            read_each = getattr(self.store, "read_each", None)
            if read_each is not None:  # straight from the store's memory into the landing buffer
                self.layout.reserve(hit)
                read_each(keys[:hit], self.layout.gather_block, deadline=deadline)
            else:
                self.store.read_into(keys[:hit], self.layout.staging(hit), deadline=deadline)
            if self.planner is not None:
                self.planner.observe_transfer(hit * self.spec.bytes_per_block, time.perf_counter() - t0,
                                              self.tier_name, LinkKind.TIER)
        except KVPortError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            _FALLBACKS.labels(type(exc).__name__).inc()
            log.warning("prefix load failed, recomputing: %s", reason)
            return Loaded(0, None, reason)
        if read_each is None:
            self.layout.gather_all(hit)
        return Loaded(hit, self.layout.cache(self.model.config, hit))

    def prefill(self, prompt: Sequence[int] | np.ndarray, room_tokens: int = 0) -> Prefill:
        """Load the longest cached prefix, compute the rest, return the cache and the first token.

        The cache lives in the engine's landing buffer (valid until the next ``prefill``), with room
        for ``room_tokens`` more tokens to be appended in place (decoding past it still works: the
        cache then grows by concatenation)."""
        t0 = time.perf_counter()
        ids = np.asarray(as_token_array(prompt), dtype=np.int64)
        if ids.size == 0:
            raise EngineError("empty prompt")
        bs = self.spec.block_size
        self.layout.reserve(-(-(len(ids) + max(0, room_tokens)) // bs))  # before any gather: growing reallocates
        keys = self.keys(ids[: ((len(ids) - 1) // bs) * bs])
        loaded = self.load(keys, prompt_tokens=len(ids))
        hit, cache, fallback = loaded.blocks, loaded.cache, loaded.fallback
        start = hit * bs
        if cache is None:
            cache = self.layout.cache(self.model.config, 0)
        with torch.inference_mode():
            first = self._forward(torch.from_numpy(ids[start:]).unsqueeze(0), cache)
        _TOKENS.labels("loaded").inc(start)
        _TOKENS.labels("computed").inc(len(ids) - start)
        return Prefill(cache, first, ids, hit, hit * self.spec.bytes_per_block, fallback, time.perf_counter() - t0)

    def decode(self, cache: Any, first_token: int, max_new_tokens: int,
               logprobs: list[float] | None = None) -> list[int]:
        """Greedy tokens after ``first_token`` (included), one forward each, until EOS or the limit.
        ``logprobs``: when given, the log-softmax of each token generated here (after ``first_token``)
        is appended to it."""
        out = [first_token]
        with torch.inference_mode():
            while len(out) < max_new_tokens and out[-1] not in self.eos:
                self._one[0, 0] = out[-1]
                out.append(self._forward(self._one, cache, logprobs))
        return out

    def save(self, tokens: np.ndarray, cache: Any, *, skip_blocks: int, lifetime: Lifetime,
             shared_prefix_tokens: int = 0) -> int:
        """Write the full blocks of ``tokens`` (whose KV ``cache`` holds) after the first ``skip_blocks``.

        Blocks that end inside the first ``shared_prefix_tokens`` tokens get ``Lifetime.PREFIX``.
        Returns the number of blocks written.
        """
        if self.store is None:
            return 0
        layers = cache_layers(cache)
        held = min(len(tokens), int(layers[0][0].shape[2]))
        keys = self.keys(tokens[:held])
        if 0 < skip_blocks <= len(keys):
            # the blocks a lookup found may have left since (evicted, found damaged by the load that
            # fell back, deleted): the save starts at the first one the store no longer holds, so the
            # chain stays whole instead of being refused for a missing parent
            skip_blocks = min(skip_blocks, self.store.longest_prefix(keys[:skip_blocks],
                                                                     deadline=current_deadline()))
        n_new = len(keys) - skip_blocks
        if n_new <= 0:
            return 0
        n_prefix = max(0, min(len(keys), shared_prefix_tokens // self.spec.block_size) - skip_blocks)
        parent = keys[skip_blocks - 1] if skip_blocks else None
        spans = ((skip_blocks, skip_blocks + n_prefix, Lifetime.PREFIX), (skip_blocks + n_prefix, len(keys), lifetime))
        write_each = getattr(self.store, "write_each", None)
        if write_each is not None:  # straight from the cache into the stored values (no staging)
            fill = self.layout.block_filler(layers, len(keys))
            for a, b, lt in spans:
                if b > a:
                    write_each(keys[a:b], lambda i, dst, a=a: fill(a + i, dst), lt, parent)
                    parent = keys[b - 1]
            return n_new
        blocks = self.layout.scatter_from_cache(layers, skip_blocks, n_new)
        for a, b, lt in spans:
            if b > a:
                self.store.write(keys[a:b], blocks[a - skip_blocks : b - skip_blocks], lt, parent)
                parent = keys[b - 1]
        return n_new

    # ------------------------------------------------------------------ one request
    def generate(self, prompt: Sequence[int] | np.ndarray, max_new_tokens: int, *,
                 lifetime: Lifetime = Lifetime.SESSION, shared_prefix_tokens: int = 0,
                 store_output: bool = True) -> GenerationResult:
        """Greedy generation reusing (and then storing) the prompt's KV blocks."""
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        t0 = time.perf_counter()
        pf = self.prefill(prompt, room_tokens=max_new_tokens)
        ttft = time.perf_counter() - t0
        gen = self.decode(pf.cache, pf.first_token, max_new_tokens)
        stored, store_error = 0, None
        if self.store is not None:
            # the cache holds the prompt and every generated token but the last
            seq = np.concatenate([pf.prompt, np.asarray(gen[:-1], dtype=np.int64)])
            try:
                stored = self.save(seq if store_output else pf.prompt, pf.cache, skip_blocks=pf.cached_blocks,
                                   lifetime=lifetime, shared_prefix_tokens=shared_prefix_tokens)
            except KVPortError as exc:
                store_error = f"{type(exc).__name__}: {exc}"
                log.warning("storing KV blocks failed: %s", store_error)
        n_cached = pf.cached_blocks * self.spec.block_size
        return GenerationResult(tuple(gen), len(pf.prompt), n_cached, len(pf.prompt) - n_cached, ttft,
                                time.perf_counter() - t0, pf.loaded_bytes, stored, pf.fallback, store_error)
