"""KV events over ZeroMQ, the protocol of vLLM's ``ZmqEventPublisher`` (``--kv-events-config``), both ends.

::

    publisher                                         subscriber (an indexer: kvport.route, llm-d, Dynamo)
      PUB  bind ENDPOINT  --- (topic, seq: u64 BE, batch) ---> SUB, subscribed to the topic
      ROUTER bind REPLAY  <-- (b"", start seq: u64 BE) ------- DEALER: a gap in seq, or a fresh start
                          --- (b"", topic, seq, batch) ... --> every batch still buffered from start on
                          --- (b"", b"", -1: i64 BE, b"") ---> the end of the replay

Sequence numbers count batches from 0 per publisher; a subscriber that sees one skipped asks the
replay socket for what it missed (a bounded buffer: ``buffer_batches``; what fell out of it is gone,
and the subscriber says so). The publisher's thread owns both sockets (ZeroMQ sockets are not
thread-safe): :meth:`EventPublisher.publish` only queues, bounded by ``max_queue`` batches (a queue
that is full drops the batch and counts it: the engine is never held up by an indexer).

A subscriber takes at most :data:`MAX_FRAME_BYTES` per frame (``zmq.MAXMSGSIZE``) and queues at most
:data:`SUB_HWM` frames (``zmq.RCVHWM``, the replay socket too: a publisher that floods a slow
subscriber has the excess dropped there, which the subscriber sees as a gap), replays at most
:data:`MAX_REPLAY_BATCHES` at a time (a longer gap: the older part is counted lost), delivers at
most :data:`MAX_POLL_BATCHES` per :meth:`Subscription.poll` (one busy publisher does not starve the
others a reader serves), and decodes with :func:`kvport.events.wire.decode` (every count capped); a
malformed frame is counted and skipped. What a subscription holds is bounded by those counts times
4 MiB (1 GiB queued, 1 GiB replayed) against a publisher sending batches of the largest size; an
engine's batches are one scheduler step's events, kilobytes.
pyzmq is ``kvport[events]``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvport import metrics
from kvport.errors import ConfigError, KVPortError, ProtocolError
from kvport.events.wire import DEFAULT_CAPS, Batch, Caps, Event, decode, encode
from kvport.extras import require

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 4 << 20  # one batch (vLLM's are one scheduler step's events: kilobytes)
SUB_HWM = 256  # frames a subscription's socket queues
MAX_REPLAY_BATCHES = 256  # batches one replay asks for
MAX_POLL_BATCHES = 256  # batches one poll delivers
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_PUBLISHED = metrics.counter("events_published", "KV event batches published, by outcome (sent, dropped)",
                             ["outcome"])


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        require("events", __name__)  # not installed: MissingExtraError naming the extra
        raise
    return zmq


class EventPublisher:
    """Publishes batches of events on ``endpoint`` (``tcp://HOST:PORT``, port 0 for any: see
    :attr:`endpoint` once started) with a replay socket on ``replay_endpoint``."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 buffer_batches: int = 10_000, max_queue: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int | None = None, clock: Callable[[], float] = time.time) -> None:
        zmq = _zmq()
        if buffer_batches <= 0 or max_queue <= 0:
            raise ConfigError("an event publisher buffers and queues at least one batch")
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self.clock = clock
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 64)
                self.replay_endpoint: str | None = _bind(self._replay, replay_endpoint)
            else:
                self.replay_endpoint = None
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"cannot bind the event publisher ({endpoint}, {replay_endpoint}): {exc}") from exc
        self._queue: queue.Queue[list[Event] | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.seq = 0  # the next batch's
        self.dropped = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvport-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[Event]) -> bool:
        """Queue one batch (False: the queue was full, the batch dropped and counted)."""
        if not events:
            return True
        try:
            self._queue.put_nowait(list(events))
            return True
        except queue.Full:
            self.dropped += 1
            _PUBLISHED.labels("dropped").inc()
            return False

    def _run(self) -> None:
        zmq = _zmq()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError as exc:
                    log.warning("kvport events: a replay failed: %s", exc)
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                break
            payload = encode(Batch(self.clock(), tuple(events), self.rank))
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                _PUBLISHED.labels("sent").inc()
            except zmq.ZMQError as exc:
                log.warning("kvport events: batch %d not sent: %s", seq, exc)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.info("kvport events: a malformed replay request dropped")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued (for up to ``timeout_s``), then close the sockets."""
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind(sock: Any, endpoint: str) -> str:
    """Bind ``endpoint`` (``tcp://HOST:0``: any port) and return what was bound."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"an event endpoint is tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {endpoint!r}")
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        port = sock.bind_to_random_port(endpoint[:-2])
        return f"{endpoint[:-2]}:{port}"
    sock.bind(endpoint)
    return endpoint


@dataclass(frozen=True, slots=True)
class Delivery:
    seq: int
    batch: Batch
    restart: bool = False  # the publisher started over (its sequence went back to 0): what it said before is void


class Subscription:
    """One publisher, read by :meth:`poll`: batches in sequence order; a gap asks the replay socket
    for the missing batches first (what it no longer has is reported in ``lost``), a batch seen
    twice is dropped (``duplicates``), a malformed one skipped (``malformed``). A publisher that
    starts over (a restarted engine: its sequence numbers go back) is delivered with ``restart`` set.
    ``from_start``: the first batch seen, when it is not batch 0, is preceded by everything the
    replay socket still has before it (a subscriber that joins late learns the current state)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 caps: Caps = DEFAULT_CAPS, replay_timeout_s: float = 2.0, from_start: bool = False) -> None:
        zmq = _zmq()
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.caps = caps
        self.replay_timeout_s = replay_timeout_s
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sub.setsockopt(zmq.RCVHWM, SUB_HWM)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # connection events: a publisher that went away and came back (a restarted engine) starts over
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._connected_before = False
        self._reconnected = self._restart_pending = False
        self._sub.connect(endpoint)
        self.next_seq: int | None = None  # the next batch expected (None: whatever comes first)
        self.from_start = from_start
        self.duplicates = self.malformed = self.lost = self.replays = self.restarts = 0

    @property
    def socket(self) -> Any:
        """The SUB socket (to wait on several subscriptions with one ``zmq.Poller``)."""
        return self._sub

    def poll(self, timeout_s: float) -> list[Delivery]:
        """The batches that arrived within ``timeout_s`` (waiting for the first only), in order."""
        zmq = _zmq()
        self._connections()
        out: list[Delivery] = []
        wait_ms = int(max(0.0, timeout_s) * 1000)
        while len(out) < MAX_POLL_BATCHES and self._sub.poll(wait_ms):
            wait_ms = 0
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = self._frame(frames)
            if got is None:
                continue
            seq, batch = got
            # after a reconnection: a publisher that may be a new process (an engine restarted), so
            # what it said before is void; else the last batch again is a duplicate, and a step
            # further back a new publisher too (one connection never repeats)
            restart, self._reconnected = self._reconnected, False
            if not restart and self.next_seq is not None and seq < self.next_seq:
                if seq == self.next_seq - 1:
                    self.duplicates += 1
                    continue
                restart = True
                self.restarts += 1
            got_now: list[Delivery] = []
            if restart or self.next_seq is None:
                if self.from_start and seq > 0:  # what it holds already: its buffer from the start
                    got_now = self.replay(0, seq, count_lost=False)
            elif seq > self.next_seq:
                got_now = self.replay(self.next_seq, seq)
            got_now.append(Delivery(seq, batch))
            if restart:  # on the first delivery from the new publisher
                got_now[0] = Delivery(got_now[0].seq, got_now[0].batch, True)
            out.extend(got_now)
            self.next_seq = seq + 1
        return out

    def _connections(self) -> None:
        """Read the socket's connection events: connected again after a disconnection, the publisher
        may be a new process (a restarted engine: its sequence numbers start over, what it held is
        gone), so it is taken as one: forgotten, then learned again from its replay buffer."""
        zmq = _zmq()
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except (zmq.Again, ValueError):
                break
            if ev.get("event") == zmq.EVENT_CONNECTED:
                if self._connected_before:
                    self._reconnected = self._restart_pending = True
                    self.restarts += 1
                self._connected_before = True

    def reconnected(self) -> bool:
        """Whether the publisher reconnected since the last call (its next batch is delivered as a
        restart too): a reader can forget what it said at once, not at its next batch."""
        self._connections()
        got, self._restart_pending = self._restart_pending, False
        return got

    def _frame(self, frames: list[bytes]) -> tuple[int, Batch] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            return None
        try:
            return int.from_bytes(frames[1], "big"), decode(frames[2], self.caps)
        except ProtocolError as exc:
            self.malformed += 1
            log.info("kvport events: a malformed batch from %s skipped: %s", self.endpoint, exc)
            return None

    def replay(self, first: int, until: int, *, count_lost: bool = True) -> list[Delivery]:
        """Batches ``[first, until)`` from the replay socket (those it still has; the rest counted
        ``lost``). Without a replay endpoint they are all lost."""
        zmq = _zmq()
        self.replays += 1
        got: dict[int, Batch] = {}
        if until - first > MAX_REPLAY_BATCHES:  # the newest of a long gap; the rest is lost
            if count_lost:
                self.lost += until - first - MAX_REPLAY_BATCHES
            first = until - MAX_REPLAY_BATCHES
        if self.replay_endpoint is not None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            dealer.setsockopt(zmq.RCVHWM, SUB_HWM)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(self.replay_endpoint)
                dealer.send_multipart((b"", first.to_bytes(8, "big")))
                end_by = time.monotonic() + self.replay_timeout_s
                while (left := end_by - time.monotonic()) > 0 and dealer.poll(int(left * 1000)):
                    frames = dealer.recv_multipart()
                    if len(frames) == 4 and frames[2] == END_SEQ:
                        break
                    parsed = self._frame(frames[1:]) if len(frames) == 4 else None
                    if parsed is not None and first <= parsed[0] < until:
                        got[parsed[0]] = parsed[1]
            except (zmq.ZMQError, KVPortError) as exc:
                log.info("kvport events: replay from %s failed: %s", self.replay_endpoint, exc)
            finally:
                dealer.close(linger=0)
        if count_lost:
            self.lost += (until - first) - len(got)
        return [Delivery(s, got[s]) for s in sorted(got)]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["END_SEQ", "MAX_FRAME_BYTES", "MAX_POLL_BATCHES", "MAX_REPLAY_BATCHES", "SUB_HWM", "Delivery",
           "EventPublisher", "Subscription"]
