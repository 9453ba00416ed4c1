"""The discrete-event simulator: a trace through a :class:`~kvport.sim.deployment.Deployment`.

Disaggregated (``mode="pd"``), one request::

    arrive -> router: the prefill engine holding the longest prefix (ties: fewest queued tokens)
           -> its queue (FIFO; an engine holding ``hold`` finished prefills whose KV no decode
              engine has taken yet stops starting new ones: backpressure, not an unbounded buffer)
           -> lookup in its levels (device, its tiers, the shared pools); the planner's choice:
              load the prefix (each level's read path, FIFO, ``latency + bytes / bandwidth``) then
              compute the rest, or compute it all, whichever the cost model predicts faster
              (cost.py's formulas, with each read path's backlog)
           -> compute P(cached, prompt); blocks land in the top level, are written through to
              the shared pools; evictions demote down (the store's own TierIndex and policies)
           -> hand-off to the decode engine with the most free KV: a reservation of
              prompt + output tokens; streamed layer by layer beside the compute (``stream``
              "layerwise", done ``bytes / bandwidth / layers`` after the compute at the earliest)
              or after it ("after"), FIFO on that decode engine's link, through the codec if any;
              no room: it waits (counted) and the prefill engine holds it. With a credit window
              (``handoff_window_bytes``) a stream gets at most that far ahead of a decode engine with
              no batch slot free, so the prefill's last layer waits (counted: credit waits)
           -> the decode engine's next step takes it (continuous batching, up to ``max_batch``):
              its first step yields the first token (TTFT), each step one token (TPOT), the step
              costing D(batch, context tokens); the last token frees the reservation

Colocated (``mode="colocated"``): each engine runs steps of up to ``chunk_tokens`` prompt tokens of
the request at the head of its queue beside its running decodes (vLLM v1's chunked prefill), the
step costing P(chunk) + D(batch, context); the prompt's last chunk yields the first token.

Time is simulated, not slept: the conversation trace (12k requests) runs in seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvport.errors import SimInputError
from kvport.sim.caches import Hierarchy, Level
from kvport.sim.deployment import Deployment
from kvport.sim.trace import TraceRequest


@dataclass(slots=True)
class SimRequest:
    idx: int
    trace: TraceRequest
    arrival: float = -1.0
    engine: int = -1  # prefill (or colocated) engine
    decode: int = -1
    prefill_start: float = -1.0
    compute_start: float = -1.0
    prefill_end: float = -1.0
    transfer_start: float = -1.0
    transfer_end: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    hit_tokens: int = 0  # reused (device + loaded)
    loaded_tokens: int = 0  # moved from a tier
    hits_by_level: dict[str, int] = field(default_factory=dict)
    choice: str = "recompute"
    handoff_bytes: int = 0
    waited_for_decode: float = 0.0  # seconds its hand-off (pd) or admission (colocated) waited for room
    wait_since: float = -1.0  # when that wait began (-1: not waiting)
    done_prompt: int = 0  # colocated: prompt tokens computed so far
    cached: int = 0  # tokens whose KV the compute starts from


@dataclass(slots=True)
class _Prefill:
    queue: deque[SimRequest] = field(default_factory=deque)
    load_tokens: int = 0  # prompt tokens routed here and not yet computed (queued or in service)
    busy: bool = False
    held: int = 0
    stalled_since: float = -1.0
    stalled_s: float = 0.0
    busy_s: float = 0.0


@dataclass(slots=True)
class _Decode:
    capacity: int
    reserved: int = 0
    link_free: float = 0.0
    running: int = 0
    context: int = 0
    finishing: list[tuple[int, int]] = field(default_factory=list)  # (step, idx) heap
    joining: deque[SimRequest] = field(default_factory=deque)
    fresh: list[SimRequest] = field(default_factory=list)  # joined this step: first token at its end
    inbound: list[SimRequest] = field(default_factory=list)  # hand-offs on their way here
    step_started: float = 0.0
    last_step_s: float = 0.0
    stepping: bool = False
    step: int = 0
    busy_s: float = 0.0
    max_running: int = 0
    # colocated only: the engine's own prefill work
    prefills: deque[SimRequest] = field(default_factory=deque)
    prefill_now: SimRequest | None = None
    step_prefill: int = 0


@dataclass(slots=True)
class Pressure:
    decode_waits: int = 0  # hand-offs that found no decode engine with room
    decode_wait_s: float = 0.0
    prefill_stalls: int = 0  # times a prefill engine stopped starting work (holding ``hold`` prefills)
    prefill_stall_s: float = 0.0
    max_waiting: int = 0  # hand-offs waiting at once
    credit_waits: int = 0  # prefills whose last layer waited for the receiver's credit window
    credit_wait_s: float = 0.0


class Simulator:
    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.n_prefill = dep.prefill
        self.caches = Hierarchy(dep, dep.prefill)
        self.prefill_engines = [_Prefill() for _ in range(dep.prefill)]
        n_dec = dep.decode if dep.mode == "pd" else dep.prefill
        self.decoders = [_Decode(dep.engine_kv_tokens) for _ in range(n_dec)]
        self.waiting: deque[SimRequest] = deque()  # hand-offs (pd) or admissions (colocated) without room
        self.back = Pressure()
        self._heap: list[tuple[float, int, Callable[..., None], tuple[object, ...]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.reqs: list[SimRequest] = []
        self._followers: dict[int, list[int]] = {}
        self.link_bytes: dict[str, int] = {"handoff": 0}
        self.planner_choices: dict[str, int] = {}
        self.layers = max(1, dep.spec.num_layers)
        self.first_at_prefill = dep.mode == "colocated" or dep.first_token == "prefill"
        self.rejected: list[int] = []  # requests whose prompt + output no engine could ever hold
        self._settle_args: tuple[int, Sequence[int], Sequence[Level], int] = (0, (), (), 0)
        self._pending_settle: dict[int, tuple[int, Sequence[int], Sequence[Level], int]] = {}

    # ------------------------------------------------------------------ events
    def _at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self, trace: Sequence[TraceRequest]) -> list[SimRequest]:
        """Every request of ``trace`` to its end (or refused, :attr:`rejected`); a simulator runs once."""
        if self.reqs:
            raise SimInputError("a Simulator runs one trace: make a new one for the next")
        for i, tr in enumerate(trace):
            if tr.after is not None and not 0 <= tr.after < i:
                raise SimInputError(f"request {i}: 'after' must name an earlier request, got {tr.after}")
        self.reqs = [SimRequest(i, r) for i, r in enumerate(trace)]
        for r in self.reqs:
            if r.trace.after is None:
                self._at(r.trace.arrival_s, self._arrive, r)
            else:
                self._followers.setdefault(r.trace.after, []).append(r.idx)
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
        return self.reqs

    def _arrive(self, r: SimRequest) -> None:
        r.arrival = self.now
        if r.trace.input_tokens + r.trace.output_tokens > self.dep.engine_kv_tokens:
            self.rejected.append(r.idx)  # would wait forever: refused at once, counted
            for f in self._followers.pop(r.idx, ()):
                fr = self.reqs[f]
                self._at(max(fr.trace.arrival_s, self.now + fr.trace.delay_s), self._arrive, fr)
            return
        blocks = r.trace.full_blocks(self.dep.block_tokens)
        if self.n_prefill == 1:
            e = 0
        else:  # cache-aware: the longest prefix an engine holds itself, then the shortest queue
            e = max(range(self.n_prefill), key=lambda i: (self.caches.local_hit(i, blocks),
                                                           -self._load_of(i), -i))
        r.engine = e
        self.prefill_engines[e].load_tokens += r.trace.input_tokens
        if self.dep.mode == "pd":
            eng = self.prefill_engines[e]
            eng.queue.append(r)
            self._try_prefill(e)
        else:
            d = self.decoders[e]
            d.prefills.append(r)
            self._kick(e)

    def _load_of(self, e: int) -> int:
        return self.prefill_engines[e].load_tokens

    # ------------------------------------------------------------------ the prefix: lookup and the planner
    def _plan(self, r: SimRequest, e: int) -> float:
        """Look up ``r`` on engine ``e``, choose load or recompute, charge the reads; returns when its
        compute may start (reads done)."""
        dep = self.dep
        n = r.trace.input_tokens
        blocks = r.trace.full_blocks(dep.block_tokens)
        found = self.caches.lookup(e, blocks)
        bt = dep.block_tokens
        compute = dep.prefill_compute
        own = 0  # leading blocks in the engine's own memory: free
        while own < len(found) and found[own].read is None:
            own += 1
        dev_tokens = min(own * bt, n - 1)
        reads: dict[int, tuple[Level, int]] = {}
        for lv in found[own:]:
            if lv.read is None:  # an own block behind a read one (ids not chained): free, like the others
                continue
            cur = reads.get(id(lv))
            reads[id(lv)] = (lv, (cur[1] if cur else 0) + 1)
        all_tokens = min(len(found) * bt, n - 1)
        t = self.now
        use = own
        if reads:
            done = t
            for lv, nb in reads.values():
                assert lv.read is not None
                done = max(done, lv.free_at[0]) + lv.read.seconds(nb * self.caches.block_bytes)
            t_load = (done - t) + compute.prefill_seconds(all_tokens, n)
            t_rec = compute.prefill_seconds(dev_tokens, n)
            if not dep.planner or t_load < t_rec:
                use = len(found)
                start = t
                for lv, nb in reads.values():
                    assert lv.read is not None
                    start = max(start, lv.free_at[0]) + lv.read.seconds(nb * self.caches.block_bytes)
                    lv.free_at[0] = start
                    lv.read_bytes += nb * self.caches.block_bytes
                t = start
        r.cached = min(use * bt, n - 1)
        for i, lv in enumerate(found[:use]):  # tokens per level; the last token is always computed
            lv.hits += 1
            got = min(bt, r.cached - i * bt)
            if got > 0:
                r.hits_by_level[lv.name] = r.hits_by_level.get(lv.name, 0) + got
        r.hit_tokens = r.cached
        r.loaded_tokens = max(0, r.cached - dev_tokens) if use > own else 0
        r.choice = "load" if use > own else ("cached" if own else "recompute")
        self.planner_choices[r.choice] = self.planner_choices.get(r.choice, 0) + 1
        self._settle_args = (e, blocks, found, use)
        return t

    # ------------------------------------------------------------------ pd: prefill engines
    def _try_prefill(self, e: int) -> None:
        eng = self.prefill_engines[e]
        if eng.busy or not eng.queue:
            return
        if eng.held >= self.dep.hold:
            if eng.stalled_since < 0:
                eng.stalled_since = self.now
                self.back.prefill_stalls += 1
            return
        if eng.stalled_since >= 0:
            eng.stalled_s += self.now - eng.stalled_since
            eng.stalled_since = -1.0
        r = eng.queue.popleft()
        eng.busy = True
        r.prefill_start = self.now
        r.compute_start = self._plan(r, e)
        settle = self._settle_args
        r.prefill_end = r.compute_start + self.dep.prefill_compute.prefill_seconds(r.cached, r.trace.input_tokens)
        eng.busy_s += r.prefill_end - r.prefill_start
        r.handoff_bytes = self.dep.spec.request_bytes(self.dep.handoff_tokens(r.trace.input_tokens))
        if self.dep.stream == "layerwise":  # the stream starts with the compute, when a decode engine has room
            d = self._pick_decode(r)
            if d is not None:
                window = self.dep.handoff_window_bytes
                ready = max(r.compute_start, self._slot_free_at(d)) \
                    if window and self.dep.window_waits_for_slot else r.compute_start
                self._transfer(r, d, ready, overlap=True)
                if window:  # credits: all but the window must have left before the last layer is made
                    done = r.transfer_start + self.dep.link.seconds(self._wire_bytes(max(0, r.handoff_bytes - window)))
                    if done > r.prefill_end:
                        self.back.credit_waits += 1
                        self.back.credit_wait_s += done - r.prefill_end
                        r.transfer_end += done - r.prefill_end
                        r.prefill_end = done
                        self.decoders[d].link_free = max(self.decoders[d].link_free, r.transfer_end)
        self._at(r.prefill_end, self._prefill_done, r, settle)

    def _slot_free_at(self, d: int) -> float:
        """When decode engine ``d`` will have a batch slot for one more request (estimated from its current
        step time and the steps its earliest-finishing request has left)."""
        dec = self.decoders[d]
        if dec.running + len(dec.joining) + len(dec.inbound) < self.dep.max_batch:
            return self.now
        cands = []
        if dec.finishing:
            steps_left = max(0, dec.finishing[0][0] - dec.step)
            cands.append(dec.step_started + steps_left * dec.last_step_s)
        for q in (*dec.joining, *dec.inbound):  # not decoding yet: it arrives, then decodes all its tokens
            step = self.dep.decode_compute.decode_step_seconds(1, q.trace.input_tokens)
            left = q.trace.output_tokens - (1 if self.first_at_prefill else 0)
            cands.append(max(self.now, q.transfer_end) + left * step)
        return max(self.now, min(cands)) if cands else self.now

    def _pick_decode(self, r: SimRequest) -> int | None:
        need = r.trace.input_tokens + r.trace.output_tokens
        best = max(range(len(self.decoders)), key=lambda i: (self.decoders[i].capacity - self.decoders[i].reserved, -i))
        dec = self.decoders[best]
        if dec.capacity - dec.reserved < need or self.waiting:  # FIFO: no overtaking a waiting hand-off
            return None
        dec.reserved += need
        r.decode = best
        return best

    def _wire_bytes(self, nbytes: float) -> float:
        """What ``nbytes`` of KV take on the hand-off link (through its codec, if any)."""
        return nbytes / self.dep.codec.ratio if self.dep.codec else nbytes

    def _transfer(self, r: SimRequest, d: int, ready: float, overlap: bool) -> None:
        dep, dec = self.dep, self.decoders[d]
        nbytes = float(r.handoff_bytes)
        dur = dep.link.seconds(self._wire_bytes(nbytes))
        if dep.codec is not None:
            dur += nbytes / dep.codec.encode_bps + nbytes / dep.codec.decode_bps
        start = max(ready, dec.link_free)
        end = start + dur
        if overlap:  # the last layer leaves after the compute's last layer
            end = max(end, r.prefill_end + dur / self.layers)
        else:
            end = max(end, r.prefill_end)
        dec.link_free = end
        dec.inbound.append(r)
        r.transfer_start, r.transfer_end = start, end
        self.link_bytes["handoff"] += int(self._wire_bytes(nbytes))

    def _prefill_done(self, r: SimRequest, settle: tuple[int, Sequence[int], Sequence[Level], int]) -> None:
        e = r.engine
        if self.first_at_prefill:
            r.first_token = self.now + self.dep.overhead_s
        self.caches.settle(*settle)
        eng = self.prefill_engines[e]
        eng.load_tokens -= r.trace.input_tokens
        eng.busy = False
        eng.held += 1
        if r.decode < 0:
            d = self._pick_decode(r)
            if d is None:
                self.waiting.append(r)
                r.wait_since = self.now
                self.back.decode_waits += 1
                self.back.max_waiting = max(self.back.max_waiting, len(self.waiting))
            else:
                self._transfer(r, d, self.now, overlap=False)
        if r.decode >= 0:
            self._at(r.transfer_end, self._handed_off, r)
        self._try_prefill(e)

    def _handed_off(self, r: SimRequest) -> None:
        self.prefill_engines[r.engine].held -= 1
        self._try_prefill(r.engine)
        dec = self.decoders[r.decode]
        dec.inbound.remove(r)
        if self.first_at_prefill and r.trace.output_tokens <= 1:  # nothing left to decode
            dec.running += 1  # joins only to leave: _finish keeps the counts whole
            dec.context += r.trace.input_tokens
            self._finish(r, dec)
            return
        dec.joining.append(r)
        if not dec.stepping:
            self._step(r.decode)

    def _admit_waiting(self) -> None:
        while self.waiting:
            r = self.waiting[0]
            need = r.trace.input_tokens + r.trace.output_tokens
            best = max(range(len(self.decoders)), key=lambda i: self.decoders[i].capacity - self.decoders[i].reserved)
            if self.decoders[best].capacity - self.decoders[best].reserved < need:
                return
            self.waiting.popleft()
            self.decoders[best].reserved += need
            r.decode = best
            r.waited_for_decode = self.now - r.wait_since
            self.back.decode_wait_s += r.waited_for_decode
            r.wait_since = -1.0
            self._transfer(r, best, self.now, overlap=False)
            self._at(r.transfer_end, self._handed_off, r)

    # ------------------------------------------------------------------ decode steps (both modes)
    def _step(self, d: int) -> None:
        dec = self.decoders[d]
        dur = 0.0
        hb = self.dep.handoff_block_tokens
        while dec.joining and dec.running < self.dep.max_batch:
            r = dec.joining.popleft()
            if hb and self.dep.mode == "pd":  # the prompt's tail the hand-off did not carry
                n = r.trace.input_tokens
                dur += self.dep.decode_compute.prefill_seconds(hb * ((n - 1) // hb), n)
            dec.running += 1
            dec.context += r.trace.input_tokens
            remaining = r.trace.output_tokens - (1 if self.first_at_prefill else 0)
            heapq.heappush(dec.finishing, (dec.step + remaining, r.idx))
            if not self.first_at_prefill:
                dec.fresh.append(r)
        if self.dep.mode == "colocated":
            dur += self._prefill_chunk(d)
        if dec.running:
            dur += self.dep.decode_compute.decode_step_seconds(dec.running, dec.context)
        if dur <= 0 and not dec.running and dec.prefill_now is None:
            dec.stepping = False
            return
        dec.max_running = max(dec.max_running, dec.running)
        dec.stepping = True
        dec.step_started, dec.last_step_s = self.now, dur
        dec.busy_s += dur
        self._at(self.now + dur, self._step_done, d)

    def _step_done(self, d: int) -> None:
        dec = self.decoders[d]
        if dec.running:
            dec.step += 1
            dec.context += dec.running
        for r in dec.fresh:
            r.first_token = self.now + self.dep.overhead_s
        dec.fresh.clear()
        while dec.finishing and dec.finishing[0][0] <= dec.step:
            _, idx = heapq.heappop(dec.finishing)
            self._finish(self.reqs[idx], dec)
        if self.dep.mode == "colocated":
            self._chunk_done(d)
        if dec.running or dec.joining or dec.prefill_now is not None or dec.prefills:
            self._step(d)
        else:
            dec.stepping = False

    def _finish(self, r: SimRequest, dec: _Decode) -> None:
        r.finish = self.now + self.dep.overhead_s
        if r.first_token < 0:
            r.first_token = r.finish
        dec.running -= 1
        dec.context -= r.trace.input_tokens + r.trace.output_tokens - (1 if self.first_at_prefill else 0)
        dec.reserved -= r.trace.input_tokens + r.trace.output_tokens
        for f in self._followers.pop(r.idx, ()):  # a session's next turn: once this answer is in
            fr = self.reqs[f]
            self._at(max(fr.trace.arrival_s, r.finish + fr.trace.delay_s), self._arrive, fr)
        if self.dep.mode == "pd":
            self._admit_waiting()

    # ------------------------------------------------------------------ colocated: chunked prefill
    def _kick(self, e: int) -> None:
        if not self.decoders[e].stepping:
            self._step(e)

    def _prefill_chunk(self, e: int) -> float:
        """Seconds of this step's prefill work (loads of a request starting now included)."""
        dec = self.decoders[e]
        if dec.prefill_now is None:
            if not dec.prefills:
                dec.step_prefill = 0
                return 0.0
            r = dec.prefills[0]
            need = r.trace.input_tokens + r.trace.output_tokens
            if dec.capacity - dec.reserved < need:
                if r.wait_since < 0:
                    r.wait_since = self.now
                    self.back.decode_waits += 1
                dec.step_prefill = 0
                return 0.0
            if r.wait_since >= 0:
                r.waited_for_decode = self.now - r.wait_since
                self.back.decode_wait_s += r.waited_for_decode
                r.wait_since = -1.0
            dec.prefills.popleft()
            dec.reserved += need
            r.prefill_start = self.now
            ready = self._plan(r, e)
            r.compute_start = ready
            r.done_prompt = r.cached
            self._pending_settle[e] = self._settle_args
            dec.prefill_now = r
            lead = ready - self.now
        else:
            lead = 0.0
        r = dec.prefill_now
        chunk = min(self.dep.chunk_tokens, r.trace.input_tokens - r.done_prompt)
        dec.step_prefill = chunk
        return lead + self.dep.prefill_compute.prefill_seconds(r.done_prompt, r.done_prompt + chunk)

    def _chunk_done(self, e: int) -> None:
        dec = self.decoders[e]
        r = dec.prefill_now
        if r is None or dec.step_prefill == 0:
            return
        r.done_prompt += dec.step_prefill
        if r.done_prompt < r.trace.input_tokens:
            return
        dec.prefill_now = None
        self.prefill_engines[e].load_tokens -= r.trace.input_tokens
        r.prefill_end = self.now
        r.first_token = self.now + self.dep.overhead_s
        self.caches.settle(*self._pending_settle.pop(e))
        if r.trace.output_tokens <= 1:
            dec.running += 1  # joins only to leave: _finish keeps the counts whole
            dec.context += r.trace.input_tokens
            self._finish(r, dec)
        else:
            dec.joining.append(r)
