"""Scheduler-side bookkeeping of the connector: which blocks each step loads and saves.

I/O-free except for the store callables it is given (``contains``, and ``prefix`` for lookups),
so it is tested without vLLM.

Per request, in block units of ``B`` tokens (``keys[i]`` names prompt tokens ``[iB, (i+1)B)``)::

    0            local        hit           saved_upto        computed/B      prompt/B
    |--vLLM cache--|--loaded---|-- saved by earlier steps --|-- saved now --|-- later --|

* ``lookup`` counts the leading keys the store holds, capped at ``(prompt - 1) // B`` blocks so at
  least one prompt token is computed (vLLM needs it for the first logits).
* ``after_alloc`` turns an accepted hit into a pending load of blocks ``[local/B, hit/B)``.
* ``step`` resolves pending loads to vLLM block ids and emits the saves of every full prompt
  block whose KV is computed by the end of this step and that the store does not hold yet, as
  runs of consecutive blocks, each under its parent (the block before it in the chain), so the
  store keeps the chain and evicts it leaves first.
* Generated tokens: when ``lookup`` is given the request's live token list (vLLM's
  ``Request.all_token_ids``: prompt, then every token sampled so far), the chain goes on past the
  prompt and every full block whose KV a step computed is saved too, so the next turn's prompt
  (this turn's prompt + answer + the new message) finds the whole conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvport.errors import EngineError
from kvport.keys import BlockKey, KeyContext, chain_keys, head_keys
from kvport.spec import KVSpec

from .params import parse_dests


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Blocks of one request to move between the store and the paged KV: ``keys[j] <-> block_ids[j]``."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    parent: BlockKey | None = None  # the block before keys[0] in the chain (None at the root)
    stream: str | None = None  # a decode engine's load: the streamed hand-off holding the blocks
    # a save: the request's block index of keys[0] (its KV events name the blocks by it); not compared
    start: int = field(default=-1, compare=False)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise EngineError(f"{self.req_id}: {len(self.keys)} keys for {len(self.block_ids)} blocks")


@dataclass(frozen=True, slots=True)
class HandOff:
    """A finished request whose blocks a producer handed to a decode engine: the worker leases ``keys``
    in the shared tier for ``lease_s`` once its saves are written there, then reports ``req_id`` as
    sent (``get_finished``), and vLLM frees the request's blocks."""

    req_id: str
    keys: tuple[BlockKey, ...]
    lease_s: float


@dataclass(frozen=True, slots=True)
class StreamCopy:
    """Blocks of one request a producer's step streams to a decode engine's inbox (``dest``,
    HOST:PORT) as they are computed (:mod:`kvport.engines.vllm.stream`); saved to the store instead
    when the stream fails."""

    stream: str
    dest: str
    copy: BlockCopy
    first_block: int  # index of copy.keys[0] in the request's chain


@dataclass(frozen=True, slots=True)
class StepPlan:
    loads: tuple[BlockCopy, ...] = ()
    saves: tuple[BlockCopy, ...] = ()
    async_loads: tuple[BlockCopy, ...] = ()  # loaded in the background; done when get_finished says so
    handoffs: tuple[HandOff, ...] = ()  # committed by the worker (lease, then reported as sent)
    streams: tuple[StreamCopy, ...] = ()  # sent layer by layer during this step's forward
    kept: tuple[str, ...] = ()  # decode engine: streamed hand-offs whose first step runs now (then kept)
    discards: tuple[str, ...] = ()  # decode engine: streams no request will take (their inbox slots freed now)

    @property
    def load_blocks(self) -> int:
        return sum(len(c.keys) for c in self.loads)


@dataclass(slots=True)
class _Request:
    keys: list[BlockKey]
    num_prompt_tokens: int
    ctx: KeyContext
    tokens: Sequence[int] | None = None  # live: prompt + generated (None: the prompt's blocks only)
    local_tokens: int = 0
    hit_tokens: int = 0
    pending_load: tuple[int, int] | None = None  # block range [start, end)
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # blocks below this are in the store or were saved by an earlier step
    stream_out: tuple[str, str] | None = None  # producer: (stream id, decode inbox) its prompt goes to
    streamed_upto: int = 0  # producer: blocks below this were streamed by earlier steps
    stream_in: str | None = None  # decode engine: the stream its hand-off arrives in
    started: bool = False  # decode engine: its first step after the streamed load was planned


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """What a scheduler step says of one request (new or running)."""

    req_id: str
    computed_tokens: int  # before this step (includes loaded tokens)
    scheduled_tokens: int
    block_ids: Sequence[int] | None  # new block ids this step; all of them when ``replace``
    replace: bool


class RankKeys:
    """The keys of one tensor-parallel rank's blocks: the scheduler plans over the chain of the model
    at TP width 1 (``spec.whole``); each rank stores its own heads under :func:`kvport.keys.head_keys`
    of those keys. At width 1 every mapping is the identity (and costs nothing)."""

    def __init__(self, spec: KVSpec, ctx: KeyContext) -> None:
        self.spec, self.algo = spec, ctx.algo
        self.heads = [spec.for_rank(r, spec.tp_size).head_range for r in range(spec.tp_size)]

    def of(self, keys: Sequence[BlockKey], rank: int | None = None) -> tuple[BlockKey, ...]:
        """``keys`` as rank ``rank`` (default: this spec's) stores them."""
        lo, hi = self.heads[self.spec.tp_rank if rank is None else rank]
        return tuple(head_keys(keys, lo, hi, self.spec.num_kv_heads, self.algo))

    def _each(self, keys: Sequence[BlockKey]) -> list[tuple[BlockKey, ...]]:
        return [self.of(keys, r) for r in range(self.spec.tp_size)]

    def contains(self, store: Any) -> Callable[[BlockKey], bool]:
        """The scheduler's ``contains``: a block is held when every rank's is."""
        if self.spec.tp_size == 1:
            return store.contains  # type: ignore[no-any-return]
        return lambda key: all(store.contains(ks[0]) for ks in self._each([key]))

    def contains_many(self, store: Any) -> Callable[[Sequence[BlockKey]], list[bool]]:
        if self.spec.tp_size == 1:
            return store.contains_many  # type: ignore[no-any-return]
        return lambda keys: [all(c) for c in zip(*(store.contains_many(ks) for ks in self._each(keys)), strict=True)]

    def prefix(self, store: Any) -> Callable[[Sequence[BlockKey]], int]:
        """The scheduler's lookup: the leading blocks every rank holds (the shortest rank's prefix)."""
        if self.spec.tp_size == 1:
            return lambda keys: int(store.lookup(keys).prefix_blocks)
        return lambda keys: min(store.lookup(ks).prefix_blocks for ks in self._each(keys))

    def plan(self, plan: StepPlan) -> StepPlan:
        """The step's plan in this rank's keys (loads, saves, hand-offs, their parents)."""
        def copy(c: BlockCopy) -> BlockCopy:
            parent = None if c.parent is None else self.of([c.parent])[0]
            return replace(c, keys=self.of(c.keys), parent=parent)

        return replace(plan, loads=tuple(map(copy, plan.loads)), saves=tuple(map(copy, plan.saves)),
                       async_loads=tuple(map(copy, plan.async_loads)),
                       handoffs=tuple(replace(h, keys=self.of(h.keys)) for h in plan.handoffs),
                       streams=tuple(replace(sc, dest=self.inbox(sc.dest), copy=copy(sc.copy)) for sc in plan.streams))

    def inbox(self, dest: str) -> str:
        """This rank's inbox among a hand-off's (one per decode rank, comma-separated; the scheduler
        streams only to as many as there are ranks)."""
        dests = parse_dests(dest) or ()
        return dests[self.spec.tp_rank] if len(dests) == self.spec.tp_size else dest


class StepPlanner:
    """Per-request state between ``get_num_new_matched_tokens`` and the request's end."""

    def __init__(self, ctx: KeyContext, contains: Callable[[BlockKey], bool],
                 prefix: Callable[[Sequence[BlockKey]], int] | None = None,
                 contains_many: Callable[[Sequence[BlockKey]], list[bool]] | None = None) -> None:
        """``contains(key)``: the store holds the block; ``prefix(keys)``: how many leading keys it
        holds (one lookup; default: ``contains`` key by key); ``contains_many(keys)``: ``contains`` of
        each, in one call (default: key by key)."""
        self.ctx = ctx
        self.block_size = ctx.block_size
        self._contains = contains
        self._prefix = prefix
        self._contains_many = contains_many or (lambda keys: [contains(k) for k in keys])
        self._reqs: dict[str, _Request] = {}
        self._async: list[BlockCopy] = []  # async loads accepted since the last step
        self._handoffs: list[HandOff] = []  # hand-offs finished since the last step
        self._discards: list[str] = []  # streams given up since the last step

    def _state(self, req_id: str, prompt: Sequence[int], salt: bytes) -> _Request:
        st = self._reqs.get(req_id)
        if st is None or st.num_prompt_tokens != len(prompt):
            ctx = self.ctx.with_tenant(self.ctx.tenant_salt + salt) if salt else self.ctx
            st = _Request(keys=chain_keys(prompt, ctx), num_prompt_tokens=len(prompt), ctx=ctx)
            self._reqs[req_id] = st
        return st

    def lookup(self, req_id: str, prompt: Sequence[int], local_tokens: int, salt: bytes = b"",
               tokens: Sequence[int] | None = None, probe: bool = True) -> int:
        """Tokens beyond ``local_tokens`` (block-aligned) that the store can supply. ``tokens``: the
        request's live token list (prompt + generated), whose later full blocks are saved as well.
        ``probe=False``: the store is not asked (0; a streamed hand-off names its blocks instead)."""
        st = self._state(req_id, prompt, salt)
        st.tokens = tokens
        st.stream_in = None  # each lookup starts over: expect_stream names the stream again if it is to be used
        limit = min(len(st.keys), max(0, len(prompt) - 1) // self.block_size)
        if not probe:
            hit = 0
        elif self._prefix is not None:
            hit = min(limit, self._prefix(st.keys[:limit])) if limit else 0
        else:
            hit = 0
            while hit < limit and self._contains(st.keys[hit]):
                hit += 1
        st.local_tokens = local_tokens
        st.hit_tokens = hit * self.block_size
        return max(0, st.hit_tokens - local_tokens)

    def after_alloc(self, req_id: str, external_tokens: int, block_ids: Sequence[int] | None = None) -> None:
        """An accepted hit: a load at the request's first scheduled step, or, with ``block_ids`` (all
        the request's blocks, as vLLM allocated them for an asynchronous load), one the next step's
        plan hands to the worker's background loader at once."""
        st = self._reqs.get(req_id)
        if st is None or external_tokens <= 0:
            return
        start, end = st.local_tokens, st.local_tokens + external_tokens
        if start % self.block_size or end % self.block_size or end > st.hit_tokens:
            raise EngineError(f"{req_id}: load of tokens [{start}, {end}) does not match the lookup "
                              f"(hit {st.hit_tokens}, block size {self.block_size})")
        a, b = start // self.block_size, end // self.block_size
        if block_ids is None:
            st.pending_load = (a, b)
            return
        if b > len(block_ids):
            raise EngineError(f"{req_id}: load needs {b} blocks, vLLM allocated {len(block_ids)}")
        self._async.append(BlockCopy(req_id, tuple(st.keys[a:b]), tuple(block_ids[a:b]),
                                     st.keys[a - 1] if a else None, st.stream_in))

    def stream_to(self, req_id: str, stream: str, dest: str) -> None:
        """A producer's request whose prompt blocks go to a decode engine's inbox as steps compute
        them, instead of to the store."""
        st = self._reqs.get(req_id)
        if st is not None:
            st.stream_out = (stream, dest)

    def streamed(self, req_id: str) -> str | None:
        st = self._reqs.get(req_id)
        return None if st is None or st.stream_out is None else st.stream_out[0]

    def expect_stream(self, req_id: str, tokens: int, stream: str) -> None:
        """A decode engine's hand-off arriving in ``stream``: its first ``tokens`` tokens load from
        there (the store is asked only for what the stream lacks)."""
        st = self._reqs.get(req_id)
        if st is not None:
            st.hit_tokens = max(st.hit_tokens, tokens - tokens % self.block_size)
            st.stream_in = stream

    def stream_of(self, req_id: str) -> str | None:
        """The stream a decode request's hand-off is to be taken from (:meth:`expect_stream`), if any."""
        st = self._reqs.get(req_id)
        return None if st is None else st.stream_in

    def discard_stream(self, stream: str) -> None:
        """A decode engine's hand-off that will not be taken from its stream (the engine's own cache
        holds the prompt, or the hand-off was refused): the next step frees the stream's inbox slots."""
        self._discards.append(stream)

    def step(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        loads: list[BlockCopy] = []
        saves: list[BlockCopy] = []
        streams: list[StreamCopy] = []
        kept: list[str] = []
        for s in scheduled:
            st = self._reqs.get(s.req_id)
            if st is None:
                continue
            if s.block_ids is not None:
                if s.replace:
                    st.block_ids = list(s.block_ids)
                else:
                    st.block_ids.extend(s.block_ids)
            if st.pending_load is not None:
                a, b = st.pending_load
                st.pending_load = None
                if b > len(st.block_ids):
                    raise EngineError(f"{s.req_id}: load needs {b} blocks, vLLM allocated {len(st.block_ids)}")
                # a streamed hand-off taken in this step names its stream (the worker takes it from the inbox)
                loads.append(BlockCopy(s.req_id, tuple(st.keys[a:b]), tuple(st.block_ids[a:b]),
                                       st.keys[a - 1] if a else None, st.stream_in))
            st.saved_upto = max(st.saved_upto, st.hit_tokens // self.block_size)
            if st.stream_in is not None and not st.started:
                st.started = True
                kept.append(s.req_id)
            if st.stream_out is not None:  # every prompt block, computed or found: the decode engine's copy
                upto = min(s.computed_tokens + s.scheduled_tokens, st.num_prompt_tokens) // self.block_size
                upto = min(upto, len(st.keys), len(st.block_ids))
                if upto > st.streamed_upto:
                    a = st.streamed_upto
                    streams.append(StreamCopy(st.stream_out[0], st.stream_out[1], BlockCopy(
                        s.req_id, tuple(st.keys[a:upto]), tuple(st.block_ids[a:upto]),
                        st.keys[a - 1] if a else None), a))
                    st.streamed_upto = upto
                st.saved_upto = max(st.saved_upto, upto)
            known = st.num_prompt_tokens if st.tokens is None else max(st.num_prompt_tokens, len(st.tokens))
            done = min(s.computed_tokens + s.scheduled_tokens, known) // self.block_size
            if done > len(st.keys) and st.tokens is not None:  # generated blocks: the chain goes on
                more = st.tokens[len(st.keys) * self.block_size : done * self.block_size]
                st.keys.extend(chain_keys(list(more), st.ctx, parent=st.keys[-1] if st.keys else None))
            done = min(done, len(st.keys), len(st.block_ids))
            if done > st.saved_upto:
                have = self._contains_many(st.keys[st.saved_upto : done])
                idx = [st.saved_upto + j for j, held in enumerate(have) if not held]
                for run in _runs(idx):
                    saves.append(BlockCopy(s.req_id, tuple(st.keys[i] for i in run),
                                           tuple(st.block_ids[i] for i in run),
                                           st.keys[run[0] - 1] if run[0] else None, start=run[0]))
                st.saved_upto = done
        async_loads, self._async = tuple(self._async), []
        handoffs, self._handoffs = tuple(self._handoffs), []
        discards, self._discards = tuple(self._discards), []
        return StepPlan(tuple(loads), tuple(saves), async_loads, handoffs, tuple(streams), tuple(kept), discards)

    def hand_off(self, req_id: str, lease_s: float) -> tuple[BlockKey, ...]:
        """A producer's finished request handed to a decode engine: its prompt's keys, and a
        :class:`HandOff` the next step gives the worker to commit."""
        keys = self.prompt_keys(req_id)
        self._handoffs.append(HandOff(req_id, keys, lease_s))
        return keys

    def prompt_keys(self, req_id: str) -> tuple[BlockKey, ...]:
        """Keys of the request's full prompt blocks (empty for a request this planner never saw)."""
        st = self._reqs.get(req_id)
        return () if st is None else tuple(st.keys[: st.num_prompt_tokens // self.block_size])

    def finish(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._reqs)


def _runs(idx: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted indexes: [1, 2, 4] -> [[1, 2], [4]]."""
    out: list[list[int]] = []
    for i in idx:
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out
