"""Decode worker process: receives each request's KV layer by layer, decodes, stores the session.

One request: ``op: expect`` (sent by the router together with the prefill) starts receiving on a
background thread; ``op: decode`` (sent once the prefill worker answered with the first token)
joins it and decodes. The link is the one hand-off (:class:`~kvport.transfer.handoff.HandoffListener`,
authenticated with the run's secret; the newest link the prefill worker dialled is the one read)::

    incoming = receiver.next_transfer()          compatibility already checked at TRANSFER_BEGIN
    for layer i: wait_for_layer(i)               every block's layer i landed and passed its checksum
                 gather layer i -> cache tensors  (receive staging -> landing, one strided copy)
                 receiver.release(layer bytes)    credits back to the prefill worker (backpressure:
                                                  the receive budget bounds KV not yet consumed)
    incoming.wait()                              committed: the KV ledger recorded ACQUIRE of the
                                                  blocks from the prefill worker, with its transfer id
    crop the padded tail to N tokens, decode greedily from the prefill worker's first token
    store prompt + answer blocks in the shared tier (system prompt: PREFIX, the rest: SESSION),
    skipping the blocks the prefill worker found there already

A transfer that fails or is refused (a ``TransferError``, or an ownership error), or does not arrive
within the request's load deadline (the router's expected time for the rest of the stream, scaled
and bounded by ``KVPORT_LOAD_DEADLINE``; the receive then abandons the transfer: void, credits back,
the sender told), makes this request recompute its prefill here, from the prompt tokens, with the
same output. Restarting this process loses nothing but its
buffers: the session KV lives in the shared tier, where the server records the PUT as a hand-off to
the pool (lifetime SESSION or PREFIX). Once a request is answered the engine frees its KV and its
ledger forgets the acquired blocks: it owns nothing between requests. Storage is the store port.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from kvport.client.conn import ClientConfig
from kvport.client.port import StoreConfig, open_store
from kvport.codec.envelope import stored_bytes
from kvport.deadline import DeadlinePolicy, within
from kvport.engines.hf import BlockLayout, HFEngine, Lifetime, StoreBlocks, dynamic_cache
from kvport.errors import BufferMismatchError, DeadlineExceeded, KVPortError, PeerError, ProtocolError
from kvport.ledger import Ledger, Owner
from kvport.spec import DType, from_hf_config
from kvport.transfer import BlockTableDestination, Incoming, Receiver, TransferMeta
from kvport.transfer.handoff import HandoffListener
from kvport.workers import messages
from kvport.workers.quiet import quiet_transformers

T = TypeVar("T")
_STEP_S = 0.1  # a receive waits in steps this long, watching for its request's deadline
_REDIAL_GRACE_S = 0.5  # how long a receive waits for a new link after its link ended


class DecodeWorker:
    def __init__(self, model_dir: Path, shared_port: int, threads: int, budget_bytes: int, max_blocks: int,
                 owner: str = "decode", deadlines: DeadlinePolicy | None = None, redis_url: str | None = None,
                 secret: bytes | None = None, names: Sequence[str] = ()) -> None:
        """``secret``: the deployment's hand-off secret (the prefill worker dials with it; a new one
        when None: only whoever reads :attr:`secret` can hand off here). ``names``: further addresses
        the prefill worker may dial this worker by (a relay between them)."""
        from kvport.refmodel import load

        torch.set_num_threads(threads)
        quiet_transformers()
        model, _ = load(model_dir, prepare_if_missing=False)
        self.spec = from_hf_config(model_dir, dtype=DType.FP32)
        self.store = open_store(StoreConfig(block_bytes=stored_bytes(self.spec), redis_url=redis_url,
                                            server=ClientConfig(port=shared_port)))
        self.owner = Owner.engine(owner)
        self.kv_ledger = Ledger(owners=[self.owner])  # the KV this engine holds (peers: who hands off here)
        self.deadlines = deadlines or DeadlinePolicy()
        self.eng = HFEngine(model, self.spec, StoreBlocks(self.store, self.spec))
        self.plain = HFEngine(model, self.spec, None)  # recompute path when a transfer fails
        self.recv = BlockLayout(self.spec, capacity_blocks=max_blocks)
        self.max_blocks = max_blocks
        self.budget = budget_bytes
        self.secret = secret or secrets.token_bytes(32)
        self.receiver: Receiver | None = None
        self._connected = threading.Event()
        self._save_bps: float | None = None  # the shared tier's write speed, as saves observed it
        self._rx = ThreadPoolExecutor(1, thread_name_prefix="decode-rx")
        self._pending: dict[str, tuple[float, threading.Event, Future[tuple[Any, int, tuple[bytes, ...]]]]] = {}
        self._early: dict[str, tuple[Receiver, Incoming]] = {}  # transfers that came before their receive
        # the one hand-off (authenticated; every commit recorded as this engine acquiring the blocks
        # from the prefill engine, admitted as a peer over the link). Credits come back as layers are
        # consumed: the receive budget bounds KV not yet consumed
        self.handoff = HandoffListener("127.0.0.1:0", self.secret, self.spec, self._destination, names=names,
                                       budget_bytes=budget_bytes, ledger=self.kv_ledger, owner=self.owner,
                                       auto_release=False, on_link=self._linked)
        self.address = self.handoff.address

    def _destination(self, meta: TransferMeta) -> BlockTableDestination:
        if meta.n_blocks > self.max_blocks:  # a peer's count is capped before anything is sized by it
            raise BufferMismatchError(f"{meta.n_blocks} blocks exceed the receive buffer ({self.max_blocks})")
        if meta.n_blocks * meta.block_layer_bytes > self.budget:  # layer-wise consumption could not progress
            raise BufferMismatchError(f"one layer of {meta.n_blocks} blocks exceeds the receive budget {self.budget}")
        buf = self.recv.staging(meta.n_blocks).numpy().reshape(-1).view(np.uint8)
        return BlockTableDestination(buf, range(meta.n_blocks), meta)

    def _linked(self, rx: Receiver) -> None:
        """The prefill worker's link (authenticated); when it dials again (its link broke, or a
        transfer on it failed), the new link replaces the old one (whose transfer in flight, if any,
        aborts: the request recomputes)."""
        old, self.receiver = self.receiver, rx
        if old is not None:
            old.close()
        self._connected.set()

    def _receive(self, rid: str, n_tok: int, cancel: threading.Event) -> tuple[Any, int, tuple[bytes, ...]]:
        """The prefill worker's KV for ``rid`` as a cache of exactly ``n_tok`` tokens, its bytes, and
        the blocks this engine now owns (acquired, recorded in its KV ledger). Every wait is in short
        steps that watch ``cancel`` (set when the request's load deadline passed): a cancelled
        receive abandons its transfer (void, credits back, the sender told) and returns."""
        t0 = time.monotonic()
        while not self._connected.wait(_STEP_S):
            if cancel.is_set():
                raise DeadlineExceeded("the prefill worker did not connect before the load's deadline")
            if time.monotonic() - t0 > 60:
                raise ProtocolError("the prefill worker never connected")
        early = self._early.pop(rid, None)
        rx, inc = early if early is not None else self._next_transfer(rid, cancel)
        try:
            meta = inc.meta
            if meta.request_id != rid:
                raise ProtocolError(f"expected the KV of {rid}, got {meta.request_id}")
            n = meta.n_blocks
            if n * self.spec.block_size < n_tok or (n - 1) * self.spec.block_size >= n_tok:
                raise ProtocolError(f"{n} blocks cannot hold exactly {n_tok} tokens")
            layer_bytes = n * meta.block_layer_bytes
            layers = []
            for i in meta.layers:
                self._step(cancel, inc, lambda i=i: inc.wait_for_layer(i, timeout=_STEP_S))  # type: ignore[misc]
                k, v = self.recv.gather_layer(n, i)
                layers.append((k[:, :, :n_tok], v[:, :, :n_tok]))
                rx.release(layer_bytes, inc)
            self._step(cancel, inc, lambda: inc.wait(timeout=_STEP_S))
        except BaseException:
            rx.abandon(inc, "the decode worker gave up on this transfer")
            raise
        return dynamic_cache(self.eng.model.config, layers), meta.total_bytes, meta.block_keys

    def _next_transfer(self, rid: str, cancel: threading.Event) -> tuple[Receiver, Incoming]:
        """The next transfer on the current link. A link that the prefill worker replaced (it dialed
        again) is left for the new one, also while waiting: the request's KV comes on the new link.
        A link that ended without a replacement (within a short grace: the new dial may still be on
        its way) fails the receive, and the request recomputes. A transfer of another request this
        worker expects (this request's own never came: its prefill could not send it) is kept for
        that request's receive instead of being taken for this one's."""
        ended_at: float | None = None
        while True:
            if cancel.is_set():
                raise DeadlineExceeded("the load's deadline passed before the KV arrived")
            rx = self.receiver
            if rx is None:
                raise ProtocolError("the prefill worker never connected")
            try:
                inc = rx.next_transfer(timeout=_STEP_S)
                other = inc.meta.request_id
                if other != rid and other in self._pending and other not in self._early:
                    self._early[other] = (rx, inc)
                    continue
                return rx, inc
            except PeerError:
                if not rx.closed.is_set() or self.receiver is not rx:
                    ended_at = None
                    continue
                ended_at = time.monotonic() if ended_at is None else ended_at
                if time.monotonic() - ended_at > _REDIAL_GRACE_S:
                    raise

    def _step(self, cancel: threading.Event, inc: Incoming | None, wait: Callable[[], T]) -> T:
        """``wait()`` (which times out after ``_STEP_S`` with PeerError) until it succeeds, or until
        ``cancel`` is set (DeadlineExceeded) or the link fails for good."""
        while True:
            if cancel.is_set():
                raise DeadlineExceeded("the load's deadline passed before the KV arrived")
            try:
                return wait()
            except PeerError:
                rx = self.receiver
                if rx is None or rx.closed.is_set() or (inc is not None and inc.settled):
                    raise

    def expect(self, rid: str, n_tok: int) -> None:
        if rid in self._pending:
            raise ProtocolError(f"request {rid} is already expected")
        cancel = threading.Event()
        self._pending[rid] = (time.perf_counter(), cancel, self._rx.submit(self._receive, rid, n_tok, cancel))

    def decode(self, msg: dict[str, Any]) -> dict[str, Any]:
        rid, prompt = str(msg["rid"]), np.asarray(msg["prompt"], dtype=np.int64)
        first, max_new = int(msg["first_token"]), int(msg["max_new"])
        if rid not in self._pending:
            self.expect(rid, len(prompt))
        t_expect, cancel, fut = self._pending.pop(rid)
        t0 = time.perf_counter()
        expected = msg.get("expected_s")
        deadline = self.deadlines.for_expected(float(expected) if isinstance(expected, int | float) else None)
        fallback: str | None = None
        received = 0
        acquired: tuple[bytes, ...] = ()
        try:
            try:
                cache, received, acquired = fut.result(timeout=deadline.remaining())
            except FutureTimeout:
                cancel.set()  # the receive abandons its transfer and returns within a step
                fut.exception(timeout=10 * _STEP_S)
                raise DeadlineExceeded("no KV within the load's deadline") from None
        except KVPortError as exc:
            fallback = f"{type(exc).__name__}: {exc}"
            pf = self.plain.prefill(prompt)
            cache = pf.cache
            if pf.first_token != first:
                fallback += f" (recomputed first token {pf.first_token} != {first})"
        recv_s = time.perf_counter() - t0
        logprobs: list[float] = []  # of the tokens after the first (the prefill worker reports its own)
        tokens = self.eng.decode(cache, first, max_new, logprobs)
        decode_s = time.perf_counter() - t0 - recv_s
        seq = np.concatenate([prompt, np.asarray(tokens[:-1], dtype=np.int64)])
        stored, store_error = 0, None
        skip = int(msg["hit_blocks"])
        n_save = max(0, len(seq) // self.spec.block_size - skip)
        # a save has a deadline as a load does (the bytes at the speed earlier saves reached; before
        # one was measured, the policy's maximum: the hand-off link's speed says nothing of the
        # shared tier's, whose first puts also fault its pages in): a stalled or full shared tier
        # costs the session's reuse, not the answer. Blocks stored before it passed stay (each is
        # whole and sealed).
        bps = self._save_bps
        expected = None if bps is None else n_save * self.spec.bytes_per_block / bps
        ts = time.perf_counter()
        try:
            with within(self.deadlines.for_expected(expected)):
                stored = self.eng.save(seq, cache, skip_blocks=skip, lifetime=Lifetime.SESSION,
                                       shared_prefix_tokens=int(msg["shared_prefix_tokens"]))
            if stored:
                bps = stored * self.spec.bytes_per_block / max(time.perf_counter() - ts, 1e-6)
                self._save_bps = bps if self._save_bps is None else 0.5 * (self._save_bps + bps)
        except KVPortError as exc:
            store_error = f"{type(exc).__name__}: {exc}"
        owned = sum(1 for k in acquired if self.kv_ledger.knows(k))
        for k in acquired:  # answered: the engine frees its copy (the session lives in the pool)
            if self.kv_ledger.knows(k):
                self.kv_ledger.forget(k)
        return {"ok": True, "rid": rid, "tokens": tokens, "logprobs": logprobs, "recv_wait_s": recv_s,
                "decode_s": decode_s, "since_expect_s": time.perf_counter() - t_expect,
                "received_bytes": received, "stored_blocks": stored, "fallback": fallback,
                "store_error": store_error, "acquired_blocks": owned, "owned_after": len(self.kv_ledger)}

    def close(self) -> None:
        self._rx.shutdown(wait=False, cancel_futures=True)
        self.handoff.close()
        self.store.close()


def main(conn: Connection, cfg: dict[str, Any]) -> None:
    """Process entry: build the worker, report its transfer port, answer control messages."""
    try:
        w = DecodeWorker(Path(cfg["model_dir"]), int(cfg["shared_port"]), int(cfg["threads"]),
                         int(cfg["budget_bytes"]), int(cfg["max_blocks"]), str(cfg.get("owner", "decode")),
                         DeadlinePolicy(*cfg.get("load_deadline", (1.0, 4.0, 30.0))), cfg.get("redis_url"),
                         bytes.fromhex(str(cfg["secret"])), [str(n) for n in cfg.get("names", ())])
    except Exception as exc:  # the router reports it; nothing else can
        messages.send(conn, {"op": "ready", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    messages.send(conn, {"op": "ready", "ok": True, "address": w.address})

    def expect(msg: dict[str, Any]) -> dict[str, Any]:
        w.expect(str(msg["rid"]), int(msg["n_tokens"]))
        return {"op": "expecting"}

    messages.serve(conn, {"expect": expect, "decode": lambda msg: {"op": "decoded", **w.decode(msg)}}, w.close)
