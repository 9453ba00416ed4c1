"""Prefill worker process: lookup, planner, load-or-recompute, and layer-wise streaming to decode.

One request (``op: prefill``)::

    keys = chain_keys(prompt, include_partial)         n = ceil(N / B) blocks, the tail zero-padded
    hit  = store.longest_prefix(keys[: (N-1)//B])      host tier (local) or shared tier (other process)
    planner.decide(N, cached=hit)  -> load | split | recompute, with its reason
    load: read hit blocks into staging[:use], one gather into the cache     (split is executed as load)
    sender.begin(meta)                                  compatibility verdict before any payload
    forward(prompt[use*B:])                             a hook after each decoder layer i scatters that
        layer i done -> staging[use:n, i] -> queue      layer's new tokens into staging and queues it;
    sender thread: send_layer(i, staging[:, i])         the sender thread streams it within its credits
    first token -> answer (TTFT);  sender.end() -> committed: a recorded hand-off

Ownership: the KV this engine computes or loads for a request is registered in its KV ledger as the
engine's own; the transfer moves it (``begin_transfer`` after the decode worker accepted) and the
commit records HANDED_OFF to the decode worker's owner with the transfer id, which the decode
worker records as ACQUIRE. Whatever is still the engine's after the request (an aborted transfer)
is freed and forgotten: the engine owns nothing between requests. Storage is the store port
(:func:`kvport.client.port.open_port`: host tier over the shared tier).

Backpressure: the decode worker grants credits from the receive buffer it has free; the sender never
has more bytes in flight than granted (credit waits are counted), and new prompts are admitted only
while the window is below its high watermark (``try_admit``; rejections are counted and waited out).
"""

from __future__ import annotations

import queue
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvport import metrics
from kvport.client.conn import ClientConfig
from kvport.client.port import StoreConfig, open_port
from kvport.codec.envelope import stored_bytes
from kvport.deadline import DeadlinePolicy
from kvport.engines.hf import HFEngine, StoreBlocks
from kvport.errors import ConfigError, KVPortError, PeerError
from kvport.keys import chain_keys
from kvport.ledger import Ledger, Move, Owner
from kvport.planner import Action, Cached, Load, Planner, Request
from kvport.planner.profile import LinkKind, machine_id
from kvport.spec import DType, from_hf_config
from kvport.transfer import Rejected, RejectReason, Sender, TransferMeta
from kvport.transfer.handoff import HandoffDialer
from kvport.transfer.sender import Outgoing
from kvport.workers import messages
from kvport.workers.calibrate import quick_profile
from kvport.workers.quiet import quiet_transformers

SHARED = "shared"


class PrefillWorker:
    def __init__(self, model_dir: Path, shared_port: int, threads: int, host_bytes: int, secret: bytes,
                 owner: str = "prefill", deadlines: DeadlinePolicy | None = None,
                 redis_url: str | None = None) -> None:
        from kvport.refmodel import load

        torch.set_num_threads(threads)
        quiet_transformers()
        model, _ = load(model_dir, prepare_if_missing=False)
        self.spec = from_hf_config(model_dir, dtype=DType.FP32)
        bb = stored_bytes(self.spec)  # one sealed block (envelope + KV) per host page
        opened = open_port(StoreConfig(block_bytes=bb, host_bytes=max(host_bytes, 4 * bb), redis_url=redis_url,
                                       server=ClientConfig(port=shared_port)))
        if opened.server is None:  # a server is configured just above: the port always opens its tier
            raise ConfigError("the prefill worker's store has no shared tier")
        self.store, self.shared = opened.store, opened.server
        self.owner = Owner.engine(owner)
        self.kv_ledger = Ledger(owners=[self.owner])  # the KV this engine holds for its requests
        self.deadlines = deadlines or DeadlinePolicy()
        self.blocks = StoreBlocks(self.store, self.spec)
        self.eng = HFEngine(model, self.spec, self.blocks)
        self.planner = Planner(quick_profile(self.eng, self.shared), machine=machine_id())
        self.secret = secret
        self.dialer: HandoffDialer | None = None  # to the decode worker the router named (op: connect)
        self.dest = ""
        self._layers: queue.Queue[int | None] = queue.Queue()
        self._active: tuple[int, int] | None = None  # (first new block, prompt tokens) while a prefill runs
        self._cache: Any = None
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def after_layer(_module: Any, _args: Any, _out: Any) -> None:
            if self._active is None:
                return
            first, tokens = self._active
            lyr = self._cache.layers[i]
            self.eng.layout.scatter_layer(i, lyr.keys, lyr.values, first, tokens)
            self._layers.put(i)

        return after_layer

    def connect(self, address: str) -> None:
        """Hand off to the decode worker at ``address`` from now on (the one hand-off,
        :mod:`kvport.transfer.handoff`: authenticated with the deployment's secret, each commit a
        recorded hand-off to the owner the decode worker names). The link is dialled now, so a
        decode worker that cannot be reached is an error here, not in the next request."""
        dialer = HandoffDialer(self.secret, [address], ledger=self.kv_ledger, owner=self.owner,
                               credit_timeout_s=60.0)
        dialer.keep(address, dialer.sender(address))
        old, self.dialer, self.dest = self.dialer, dialer, address
        if old is not None:  # after the new link is up: the decode worker moves over to it
            old.close()

    # ------------------------------------------------------------------ one request
    def _sender(self) -> Sender:
        """The link for this request: the idle one when it still works, else a new one (the decode
        worker moves over to it)."""
        if self.dialer is None:
            raise PeerError("no decode worker connected (op: connect)")
        return self.dialer.sender(self.dest)

    def _link_expected_s(self, nbytes: int) -> float:
        """``nbytes`` over a loopback socket, as the calibration measured the shared tier's link."""
        link = self.planner.profile.link(SHARED) if self.planner.profile is not None else None
        return link.seconds(nbytes) if link is not None else 0.0

    def _lookup_expected_s(self) -> float:
        return 2 * self._link_expected_s(0)

    def _admit(self, errors: list[KVPortError]) -> tuple[Sender | None, int]:
        """This request's link once it admits a new transfer, and the rejections waited out. A link
        that broke (a write cut at a deadline, the decode worker restarted) is dialled again; when
        that fails too, this request's transfer fails (in ``errors``) and the decode worker recomputes."""
        rejections = 0
        try:
            sender = self._sender()
        except KVPortError as exc:
            errors.append(exc)
            return None, rejections
        deadline, redialled = time.monotonic() + 30.0, False
        while time.monotonic() < deadline:
            adm = sender.try_admit()
            if not isinstance(adm, Rejected):
                break
            rejections += 1
            if adm.reason is RejectReason.PEER_FAILED:
                sender.close()
                if redialled:  # a new link that failed at once: this request's transfer fails
                    errors.append(PeerError(f"the link to the decode worker failed again: {adm.detail}"))
                    return None, rejections
                try:
                    sender, redialled = self._sender(), True
                except KVPortError as exc:
                    errors.append(exc)
                    return None, rejections
                continue
            time.sleep(adm.retry_after_s if adm.retry_after_s is not None else 0.05)
        return sender, rejections

    def _stream(self, sender: Sender, h: Outgoing, rows: np.ndarray, n: int, errors: list[KVPortError],
                busy: list[float]) -> None:
        for _ in range(self.spec.num_layers):
            i = self._layers.get()
            if i is None:
                return
            if errors:
                continue
            t0 = time.perf_counter()
            try:
                sender.send_layer(h, i, [rows[j, i] for j in range(n)])
            except KVPortError as exc:
                errors.append(exc)
            busy.append(time.perf_counter() - t0)

    def prefill(self, msg: dict[str, Any]) -> dict[str, Any]:

        rid, prompt = str(msg["rid"]), np.asarray(msg["prompt"], dtype=np.int64)
        n_tok, bs = len(prompt), self.spec.block_size
        waits0 = metrics.sample("transfer_credit_waits_total") or 0.0
        wait_s0 = metrics.sample("transfer_credit_wait_seconds_sum") or 0.0
        errors: list[KVPortError] = []
        sender, rejections = self._admit(errors)
        while not self._layers.empty():  # nothing of an earlier request may reach this stream
            self._layers.get_nowait()
        t0 = time.perf_counter()
        keys = chain_keys(prompt, self.eng.key_ctx, include_partial=True)
        n = len(keys)
        for k in keys:  # this request's KV, computed or loaded here, is the engine's until handed off
            self.kv_ledger.register(k, self.owner)
        fallback: str | None = None
        try:  # a lookup is a round trip or two to the shared tier: bounded like a tiny load
            hit = self.blocks.longest_prefix(keys[: (n_tok - 1) // bs],
                                             deadline=self.deadlines.for_expected(self._lookup_expected_s()))
        except KVPortError as exc:
            hit, fallback = 0, f"{type(exc).__name__}: {exc}"
        tiers = {t: self.blocks.last_tiers.count(t) for t in set(self.blocks.last_tiers)}
        cached = (Cached(SHARED, hit * bs),) if hit else ()
        decision = self.planner.decide(Request(prompt_tokens=n_tok, spec=self.spec, cached=cached), Load())
        use = hit if decision.action in (Action.LOAD, Action.SPLIT) else 0
        self.eng.layout.reserve(n)
        staging = self.eng.layout.staging(n)
        cache = None
        load_s = 0.0
        if use:
            try:
                tl = time.perf_counter()
                # a load has a deadline: the planner's expected time, scaled and bounded; past it, recompute
                self.blocks.read_into(keys[:use], staging,
                                      deadline=self.deadlines.for_expected(decision.choice.seconds))
                self.eng.layout.gather_all(use)
                cache = self.eng.layout.cache(self.eng.model.config, use)  # the rest is appended in place
                load_s = time.perf_counter() - tl
                self.planner.observe_transfer(use * self.spec.bytes_per_block, load_s, SHARED, LinkKind.TIER)
            except KVPortError as exc:
                use, cache, fallback = 0, None, f"{type(exc).__name__}: {exc}"
        if cache is None:
            cache = self.eng.layout.cache(self.eng.model.config, 0)
        # stream: begin (compatibility check) before computing, layers as they finish
        busy: list[float] = []
        h: Outgoing | None = None
        # the hand-off has a deadline too, the policy's maximum: a decode worker that stops reading,
        # a frame lost on the way or a cut link end the transfer there (aborted; the decode worker
        # recomputes), not in a hang. Not the planner's prefill and link time, scaled: a decode
        # worker still decoding the previous turn holds its credits for a while by design
        # (pipelining), and its own load deadline already bounds what the request waits for
        handoff = self.deadlines.for_expected(None)
        try:
            if sender is not None:
                h = sender.begin(TransferMeta(self.spec, rid, tuple(keys)), deadline=handoff)
        except KVPortError as exc:
            errors.append(exc)
        rows = staging.numpy().reshape(n, self.spec.num_layers, -1).view(np.uint8)
        streamer = None
        if h is not None:
            streamer = threading.Thread(target=self._stream, args=(sender, h, rows, n, errors, busy), daemon=True)
            streamer.start()
        self._cache, self._active = cache, (use, n_tok) if streamer is not None else None
        tc = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.eng.model(input_ids=torch.from_numpy(prompt[use * bs :]).unsqueeze(0),
                                     past_key_values=cache, use_cache=True, logits_to_keep=1)
            first = int(out.logits[0, -1].argmax())
            first_logprob = float(torch.log_softmax(out.logits[0, -1].float(), dim=-1)[first])
        except BaseException:
            self._layers.put(None)  # stop the streamer; the transfer is aborted below
            raise
        finally:
            self._active, self._cache = None, None
        ttft = time.perf_counter() - t0
        compute_s = time.perf_counter() - tc
        self.planner.observe_prefill(n_tok - use * bs, compute_s, cached=use * bs)
        committed = False
        if sender is not None and streamer is not None and h is not None:
            streamer.join(120)
            try:
                if errors:
                    raise errors[0]
                sender.end(h)
                committed = True
            except KVPortError as exc:
                if not errors:
                    errors.append(exc)
                if not h.done:
                    sender.abort(h, str(exc))
        if sender is not None:
            if committed:
                self.dialer.keep(self.dest, sender)  # type: ignore[union-attr]  # a sender came from it
            else:
                # a transfer that failed leaves its link in a state no one can vouch for (credits the
                # peer never returned for a frame it never got, a connection stuck in retransmission
                # after a partition, a link the decode worker already gave up): the next request
                # starts on a fresh one, and the decode worker moves over to it
                sender.close()
        done_s = time.perf_counter() - t0
        handed = 0
        if committed and h is not None and h.ledger_tid:
            handed = sum(1 for r in self.kv_ledger.history if r.move is Move.HANDED_OFF and r.tid == h.ledger_tid)
        for k in keys:  # not handed off (an aborted transfer): the engine frees it
            if self.kv_ledger.knows(k):
                self.kv_ledger.forget(k)
        return {
            "ok": True, "rid": rid, "first_token": first, "first_logprob": first_logprob, "ttft_s": ttft,
            "handoff_s": done_s,
            "prompt_tokens": n_tok, "hit_tokens": hit * bs, "loaded_tokens": use * bs, "hit_tiers": tiers,
            "load_s": load_s, "compute_s": compute_s, "action": decision.action.value,
            "choice": decision.choice.label, "reason": decision.reason,
            "predicted": {o.label: o.seconds for o in decision.options}, "fallback": fallback,
            "transfer_bytes": n * self.spec.num_layers * self.spec.bytes_per_layer_block,
            "transfer_busy_s": sum(busy), "transfer_tail_s": done_s - ttft, "committed": committed,
            "transfer_error": f"{type(errors[0]).__name__}: {errors[0]}" if errors else None,
            "credit_waits": (metrics.sample("transfer_credit_waits_total") or 0.0) - waits0,
            "credit_wait_s": (metrics.sample("transfer_credit_wait_seconds_sum") or 0.0) - wait_s0,
            "admission_rejections": rejections, "handed_off_blocks": handed,
            "ledger_tid": h.ledger_tid if h is not None else "", "owned_after": len(self.kv_ledger),
        }

    def close(self) -> None:
        if self.dialer is not None:
            self.dialer.close()
        self.store.close()


def main(conn: Connection, cfg: dict[str, Any]) -> None:
    """Process entry: build the worker, answer control messages until ``stop``."""
    try:
        w = PrefillWorker(Path(cfg["model_dir"]), int(cfg["shared_port"]), int(cfg["threads"]),
                          int(cfg["host_bytes"]), bytes.fromhex(str(cfg["secret"])), str(cfg.get("owner", "prefill")),
                          DeadlinePolicy(*cfg.get("load_deadline", (1.0, 4.0, 30.0))), cfg.get("redis_url"))
    except Exception as exc:  # the router reports it; nothing else can
        messages.send(conn, {"op": "ready", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    messages.send(conn, {"op": "ready", "ok": True, "profile": w.planner.profile.as_dict()
                         if w.planner.profile else None})

    def connect(msg: dict[str, Any]) -> dict[str, Any]:
        w.connect(str(msg["address"]))
        return {"op": "connected"}

    messages.serve(conn, {"connect": connect, "prefill": lambda msg: {"op": "prefilled", **w.prefill(msg)}}, w.close)
