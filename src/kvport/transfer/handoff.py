"""The hand-off between engines, below every engine: a request's KV streamed to a named destination
over an authenticated link (the address picks the transport: :mod:`kvport.transfer.links`), each
transfer all-or-nothing (:class:`~kvport.transfer.receiver.Receiver`), and, with ledgers on both
sides, recorded in both with one transfer id.

::

    sending engine                                      receiving engine
    HandoffDialer(secret, destinations, ledger, owner)  HandoffListener(address, secret, spec, destination,
      .sender(dest)  a pooled Sender, dialled only to     ledger, owner)
                     one of ``destinations``,            accept thread: never talks to a peer
                     authenticated, signed for ``dest``  per connection: authenticate (links.HANDSHAKE_S)
      sender.begin / layers / end ------------------->     -> Receiver(ledger, owner, admit_peer).serve()
      (ledger: the blocks go to the transfer at ACCEPT,    TRANSFER_END, every block-layer verified:
       HANDED_OFF to the receiver's owner at COMMITTED)    ACQUIRE(owner, from=sender, tid), then linked
      .keep(dest, sender)  back into the pool            at most ``max_connections``; a transfer still
                                                         receiving ``transfer_s`` after its BEGIN is
                                                         abandoned (its destination aborted)

Peers on an authenticated link: the deployment's secret is what lets an engine in, so an engine
owner that arrives over such a link becomes a peer of the ledger at its first transfer
(:class:`AuthenticatedPeers`, bounded); a peer that names itself anew per transfer cannot grow the
ledger without bound. :func:`engine_owner` is how an engine on the hand-off is named in ledgers.

:func:`records` asks a listener, over the same authenticated link, for the newest ownership moves
of its ledger (HANDOFF_RECORDS): what its engine acquired, from whom, when, with which transfer id,
and where the blocks went since (handed to the pool, forgotten). ``kvport inspect --handoff``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvport.errors import ConfigError, KVPortError, PeerError, ProtocolError
from kvport.ledger.states import Owner, OwnerKind
from kvport.protocol.errors import remote_error
from kvport.protocol.frame import MsgType
from kvport.protocol.rejects import Rejected, RejectReason
from kvport.protocol.sync import FrameIO
from kvport.protocol.transfer import MAX_RECORDS, HandoffRecords, HandoffRecordsAnswer
from kvport.spec import KVSpec
from kvport.transfer import links
from kvport.transfer.destination import DestinationFactory
from kvport.transfer.receiver import InState, Receiver
from kvport.transfer.sender import Sender

if TYPE_CHECKING:
    from kvport.ledger import Ledger

log = logging.getLogger(__name__)

MAX_PEERS = 256  # engine owners a ledger admits over authenticated links
IDLE_TIMEOUT_S = 3600.0  # a producer keeps its connection between hand-offs: idle for long is normal
MAX_CONNECTIONS = 64  # sender connections a listener serves at once (a thread and ~1 MiB each)
TRANSFER_S = 120.0  # a transfer still receiving this long after its TRANSFER_BEGIN is abandoned
POOL_PER_DEST = 4  # idle connections a dialer keeps per destination


def engine_owner(role: str, address: str) -> Owner:
    """The ledger name of an engine on the hand-off: its role and the address it is reached at."""
    return Owner.engine(f"{role}@{address}")


class AuthenticatedPeers:
    """Admits, as peers of ``ledger``, the engine owners that arrive over authenticated links, up to
    ``limit`` of them (the pool, transfers and clients are never peers)."""

    def __init__(self, ledger: Ledger, limit: int = MAX_PEERS) -> None:
        self.ledger, self.limit = ledger, limit

    def __call__(self, owner: Owner) -> bool:
        if owner.kind is not OwnerKind.ENGINE:
            return False
        if owner in self.ledger.peers:
            return True
        if len(self.ledger.peers) >= self.limit:
            log.warning("kvport: hand-off peer %s refused: the ledger knows %d peers (the cap)", owner, self.limit)
            return False
        self.ledger.add_peer(owner)
        return True


class HandoffListener:
    """The receiving side: listens on ``address`` (``HOST:PORT``, ``shm:NAME`` or ``nixl:HOST:PORT``, every connection
    authenticated with ``secret``, the handshake bound to ``address`` and ``names``) and serves a
    :class:`Receiver` into ``destination`` per connection, on its own thread. One thread accepts and
    never talks to a peer. With ``ledger`` / ``owner`` every commit is recorded as ``owner`` acquiring
    the blocks from the sender's owner (a peer admitted over the authenticated link).

    A consumer that takes transfers itself (layer by layer, as they land: ``Receiver.next_transfer``)
    passes ``on_link``, called with each authenticated link's Receiver before it serves, and
    ``auto_release=False`` to grant credits back as it frees what it consumed (``Receiver.release``):
    the receive budget then bounds KV not yet consumed, not only bytes in flight.

    ``reshard``: senders of another TP width are accepted for the heads they share with ``spec``,
    into a ``destination`` that assembles them (:class:`kvport.transfer.reshard.Assemblies`)."""

    def __init__(self, address: str, secret: bytes | None, spec: KVSpec, destination: DestinationFactory, *,
                 names: Sequence[str] = (), budget_bytes: int = 32 << 20, ledger: Ledger | None = None,
                 owner: Owner | None = None, max_connections: int = MAX_CONNECTIONS,
                 transfer_s: float = TRANSFER_S, ring: links.ShmRing | None = None, auto_release: bool = True,
                 on_link: Callable[[Receiver], None] | None = None, reshard: bool = False) -> None:
        if (ledger is None) != (owner is None):
            raise ConfigError("a hand-off listener records commits with both a ledger and its owner, or neither")
        self.spec, self.destination, self.budget_bytes = spec, destination, budget_bytes
        self.auto_release, self.on_link, self.reshard = auto_release, on_link, reshard
        self.ledger, self.owner = ledger, owner
        self.admit = None if ledger is None else AuthenticatedPeers(ledger)
        self.max_connections, self.transfer_s = max_connections, transfer_s
        self.listener = links.LinkListener(address, secret, names, idle_timeout_s=IDLE_TIMEOUT_S, ring=ring)
        self.address = self.listener.address
        self._conns: set[links.Pending] = set()
        self._receivers: set[Receiver] = set()
        self._refused: deque[KVPortError] = deque(maxlen=64)  # refusals of connections that ended
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kvport-handoff-accept", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def refusals(self) -> list[KVPortError]:
        """The TRANSFER_BEGINs this listener refused lately (the newest 64 of ended connections, and
        every one of the open ones), oldest first."""
        with self._lock:
            return [*self._refused, *(e for r in self._receivers for e in r.refusals)]

    def _accept(self) -> None:
        while not self._closed.is_set():
            self._watch()
            try:
                p = self.listener.accept(timeout_s=0.5)
            except (PeerError, OSError):  # nobody came (or the listener closed: the loop ends)
                continue
            if self._closed.is_set():
                p.close()
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(p)
            if full:
                log.warning("kvport: hand-off connection from %s refused: %d connections open (the cap)",
                            p.peer, self.max_connections)
                p.close()
                continue
            threading.Thread(target=self._serve, args=(p,), name="kvport-handoff-conn", daemon=True).start()

    def _serve(self, p: links.Pending) -> None:
        r: Receiver | None = None
        try:
            try:
                t = p.authenticate()
            except KVPortError as exc:  # a peer that failed the handshake (or its deadline): logged, closed
                log.warning("kvport: hand-off connection from %s refused (%s)", p.peer, exc)
                return
            r = Receiver(t, self.spec, self.destination, self.budget_bytes, auto_release=self.auto_release,
                         ledger=self.ledger, owner=self.owner, admit_peer=self.admit, reshard=self.reshard)
            with self._lock:
                self._receivers.add(r)
            if self.on_link is not None:
                self.on_link(r)
            if not self._closed.is_set():
                r.serve()
        finally:
            with self._lock:
                self._conns.discard(p)
                if r is not None:
                    self._receivers.discard(r)
                    self._refused.extend(r.refusals)
            p.close()

    def _watch(self) -> None:
        """Abandon transfers past ``transfer_s`` (a sender that began one and went silent)."""
        now = time.monotonic()
        with self._lock:
            late = [(r, inc) for r in self._receivers if (inc := r.current) is not None
                    and inc.state is InState.RECEIVING and now - inc.t_begin > self.transfer_s]
        for r, inc in late:
            log.warning("kvport: hand-off transfer %s (%s…) abandoned: still receiving after %.0f s",
                        inc.tid, inc.meta.request_id[:8], self.transfer_s)
            r.abandon(inc, f"the hand-off's transfer deadline ({self.transfer_s:.0f} s) passed")

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        with self._lock:
            receivers, conns = list(self._receivers), list(self._conns)
        for r in receivers:
            r.close()
        for p in conns:
            p.close()
        self._thread.join(2)


class HandoffDialer:
    """The sending side: pooled, authenticated connections to ``destinations`` only (the receivers
    its own deployment configured, never an address a request names by itself). With ``ledger`` /
    ``owner`` every transfer is recorded as a hand-off of ``owner``'s blocks to the receiver's owner
    (a peer admitted over the authenticated link). ``credit_timeout_s`` bounds every wait for
    credits; on shared memory and NIXL a frame is ``shm_frame_bytes`` (each write is a hand-off to the
    peer: a layer of a step in one piece)."""

    def __init__(self, secret: bytes | None, destinations: Iterable[str], *, ledger: Ledger | None = None,
                 owner: Owner | None = None, credit_timeout_s: float = 5.0, dial_timeout_s: float = 5.0,
                 shm_frame_bytes: int = 32 << 20, ring: links.ShmRing | None = None) -> None:
        if (ledger is None) != (owner is None):
            raise ConfigError("a hand-off dialer records transfers with both a ledger and its owner, or neither")
        self.secret = secret
        self.destinations = frozenset(destinations)
        self.ledger, self.owner = ledger, owner
        self.admit = None if ledger is None else AuthenticatedPeers(ledger)
        self.credit_timeout_s, self.dial_timeout_s = credit_timeout_s, dial_timeout_s
        self.shm_frame_bytes, self.ring = shm_frame_bytes, ring
        self._idle: dict[str, list[Sender]] = {}

    def sender(self, dest: str) -> Sender:
        """An idle pooled connection to ``dest`` that still works (its window may still be full:
        ``try_admit`` says when it may begin), or a new one (ConfigError for an
        address not among ``destinations``; PeerError / AuthError when dialling fails)."""
        if dest not in self.destinations:
            raise ConfigError(f"{dest!r} is not one of this deployment's hand-off destinations")
        pool = self._idle.get(dest, [])
        while pool:
            s = pool.pop()
            adm = s.try_admit()
            # an idle connection the peer closed is dropped; one whose window is still full (the
            # receiver has not freed the last transfer's bytes yet) is the caller's to wait out
            if not (isinstance(adm, Rejected) and adm.reason is RejectReason.PEER_FAILED):
                return s
            s.close()
        # kept between hand-offs: the connection may idle; every wait on it has its own bound
        t = links.dial(dest, self.secret, timeout_s=self.dial_timeout_s, idle_timeout_s=IDLE_TIMEOUT_S,
                       ring=self.ring)
        if dest.startswith((links.SHM_PREFIX, links.NIXL_PREFIX)):  # a frame is one hand-off to the peer
            return Sender(t, credit_timeout_s=self.credit_timeout_s, ledger=self.ledger, owner=self.owner,
                          admit_peer=self.admit, max_frame_bytes=self.shm_frame_bytes,
                          batch_bytes=self.shm_frame_bytes)
        return Sender(t, credit_timeout_s=self.credit_timeout_s, ledger=self.ledger, owner=self.owner,
                      admit_peer=self.admit)

    def keep(self, dest: str, sender: Sender) -> None:
        """``sender``'s transfer settled: its connection goes back to ``dest``'s pool (or closes)."""
        pool = self._idle.setdefault(dest, [])
        if len(pool) < POOL_PER_DEST:
            pool.append(sender)
        else:
            sender.close()

    def close(self) -> None:
        for pool in self._idle.values():
            for s in pool:
                s.close()
        self._idle.clear()


def records(address: str, secret: bytes | None, limit: int = MAX_RECORDS,
            timeout_s: float = 10.0) -> HandoffRecordsAnswer:
    """The newest ``limit`` ownership moves of the ledger behind the hand-off listener at ``address``
    (dialled and authenticated like any sender; ``kvport inspect --handoff``): what its engine
    acquired, from whom, when and under which transfer id, and where those blocks went since."""
    if not 0 < limit <= MAX_RECORDS:
        raise ConfigError(f"a hand-off answers at most {MAX_RECORDS} records, asked for {limit}")
    t = links.dial(address, secret, timeout_s=timeout_s, idle_timeout_s=timeout_s)
    try:
        io = FrameIO(t)
        io.send(MsgType.HANDOFF_RECORDS, HandoffRecords(limit).to_meta())
        f = io.expect(MsgType.HANDOFF_RECORDS_ANSWER, MsgType.ERROR)
        if f.msg_type is MsgType.ERROR:
            raise remote_error(f.meta, ProtocolError)
        return HandoffRecordsAnswer.from_meta(f.meta)
    finally:
        t.close()


__all__ = ["AuthenticatedPeers", "HandoffDialer", "HandoffListener", "engine_owner", "records"]
