"""Re-shard between tensor-parallel widths: a rank's KV assembled from the head pieces of senders of
another TP width, or split for receivers of another width, each byte on the wire once.

::

    prefill TP=3                           decode TP=1 (Receiver(reshard=True) into Assemblies)
      rank 0  heads [0, 1) ---piece--.
      rank 1  heads [1, 2) ---piece---+-->  HeadAssembly(request): heads [0,1) [1,2) [2,3)
      rank 2  heads [2, 3) ---piece--'      handed out (take) only when every head of every layer
                                            and block was verified exactly once
    prefill TP=1                           decode TP=3
      heads [0, 3) --split--> [0, 1) to rank 0, [1, 2) to rank 1, [2, 3) to rank 2
                              (each piece is its receiver's own spec: a plain transfer)

A piece is an ordinary transfer -- every block-layer verified exactly once, all or nothing
(:class:`~kvport.transfer.receiver.Receiver`) -- whose spec is ``spec.heads(lo, hi)``: the heads the
two ranks share (:meth:`KVSpec.shared_heads`), so its sizes, envelope and block keys are those of a
rank holding exactly those heads. The sender copies its share out of its blocks once (:func:`split`,
one numpy copy per piece); the receiver lands each piece in a staging buffer and, at the piece's
commit, copies it into its heads of the request's blocks (:class:`HeadAssembly`, one numpy copy).

Completeness is per head: a piece whose heads already arrived is refused (ReshardError: the first
copy stands), a piece that aborts gives its heads back (a retry may bring them), and ``take`` hands
the blocks out only when every head of the receiver's range is in -- else, at its deadline,
ReshardError naming the heads that never came (the caller recomputes). With the request's tokens
(``keys_for``) every piece's block keys are checked against those tokens under the piece's spec, so
heads of another prompt under the same request id are refused, never linked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvport.errors import ReshardError, TierFullError
from kvport.keys import KeyContext, chain_keys, head_keys
from kvport.spec import KVSpec
from kvport.transfer.destination import DestState, _Lifecycle
from kvport.transfer.meta import TransferMeta

MAX_PENDING = 64  # requests an Assemblies holds at once
MAX_BYTES = 1 << 30  # bytes of blocks an Assemblies holds at once (assembled and staged)
TTL_S = 120.0  # an assembly nobody took this long after its first piece is dropped

KeysFor = Callable[[KVSpec], Sequence[bytes]]  # the request's block keys under a piece's spec


def piece_keys(tokens: np.ndarray | Sequence[int], piece: KVSpec, ctx: KeyContext | None = None) -> list[bytes]:
    """The block keys of ``piece``'s heads for ``tokens``: the chain of the whole model (``ctx``, by
    default the one of ``piece.whole``) keyed for the heads (:func:`kvport.keys.head_keys`), what
    a rank of any width holding exactly these heads stores them under."""
    ctx = ctx or KeyContext(block_size=piece.block_size, spec_fingerprint=piece.whole.fingerprint)
    return head_keys(chain_keys(tokens, ctx), *piece.head_range, piece.num_kv_heads, ctx.algo)


def piece_for(src: KVSpec, dst: KVSpec) -> KVSpec | None:
    """The spec of what a rank of ``src`` sends a rank of ``dst``: the heads both hold (None: none).
    The model's fields must agree but for the TP width (the receiver checks them again)."""
    shared = src.shared_heads(dst)
    return None if shared is None else src.heads(*shared)


def split(blocks: np.ndarray, src: KVSpec, piece: KVSpec, out: np.ndarray | None = None) -> np.ndarray:
    """The heads of ``piece`` out of ``blocks`` (``[n, src.bytes_per_block]`` uint8, LKHTD of
    ``src``): ``[n, layers, piece.bytes_per_layer_block]``, contiguous (into ``out`` when given)."""
    n, (slo, shi), (lo, hi) = blocks.shape[0], src.head_range, piece.head_range
    if not slo <= lo < hi <= shi:
        raise ReshardError(f"heads [{lo}, {hi}) are not among this rank's [{slo}, {shi})")
    v = blocks.reshape(n, src.num_layers, src.kv_factor, shi - slo, -1)[:, :, :, lo - slo : hi - slo]
    shape = (n, src.num_layers, piece.bytes_per_layer_block)
    if out is None:
        return np.ascontiguousarray(v).reshape(shape)
    if out.shape != shape or out.dtype != np.uint8:
        raise ReshardError(f"split into a buffer of {out.shape}, needs {shape} uint8")
    out.reshape(v.shape)[...] = v
    return out


class _Piece(_Lifecycle):
    """One sender's heads of one request: received into staging, copied into the assembly at commit."""

    def __init__(self, asm: HeadAssembly, meta: TransferMeta, lo: int, hi: int) -> None:
        super().__init__()
        self.asm, self.meta, self.lo, self.hi = asm, meta, lo, hi
        self.buf = np.empty((meta.n_blocks, meta.spec.num_layers, meta.block_layer_bytes), dtype=np.uint8)

    def view(self, block: int, layer: int) -> memoryview:
        row: memoryview = self.buf[block, layer].data
        return row

    def commit(self) -> None:
        self.move(DestState.COMMITTED)
        self.asm._landed(self)
        self.buf = np.empty((0, 0, 0), dtype=np.uint8)

    def abort(self) -> None:
        if self.move(DestState.ABORTED):
            self.asm._dropped(self)


class HeadAssembly:
    """One request's KV at this rank's ``spec`` (``n_blocks`` blocks from ``token_start``), put
    together from pieces of other TP widths (:meth:`piece` is a destination per piece)."""

    def __init__(self, spec: KVSpec, request_id: str, n_blocks: int, token_start: int = 0) -> None:
        self.spec, self.request_id, self.n_blocks, self.token_start = spec, request_id, n_blocks, token_start
        self.lo, self.hi = spec.head_range
        self.blocks = np.empty((n_blocks, spec.bytes_per_block), dtype=np.uint8)  # LKHTD of ``spec``
        self._claimed = np.zeros(self.hi - self.lo, dtype=np.bool_)  # a piece for the head is open or in
        self._done = np.zeros(self.hi - self.lo, dtype=np.bool_)  # its piece committed
        self._keys: dict[tuple[int, int], tuple[bytes, ...]] = {}  # each committed piece's block keys
        self._cond = threading.Condition()
        self.t_first = time.monotonic()
        self.wire_bytes = 0  # payload bytes of the committed pieces

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes * 2  # assembled plus, at most, the same again staged

    def piece(self, meta: TransferMeta) -> _Piece:
        """The destination of one sender's piece (ReshardError when it is not part of this request
        or its heads already arrived or are arriving)."""
        s, lo, hi = meta.spec, *meta.spec.head_range
        where = f"request {self.request_id[:40]!r}"
        if meta.request_id != self.request_id or meta.n_blocks != self.n_blocks or meta.token_start != self.token_start:
            raise ReshardError(f"{where}: a piece of {meta.n_blocks} blocks from token {meta.token_start} for "
                               f"{self.n_blocks} blocks from token {self.token_start}")
        if meta.layers != range(s.num_layers):
            raise ReshardError(f"{where}: a re-shard piece carries every layer, got {meta.layers}")
        if not self.lo <= lo < hi <= self.hi or s.first_mismatch(self.spec, ("tp_size", "tp_rank")) is not None:
            raise ReshardError(f"{where}: heads [{lo}, {hi}) are not among this rank's [{self.lo}, {self.hi})")
        a, b = lo - self.lo, hi - self.lo
        with self._cond:
            if self._claimed[a:b].any():
                raise ReshardError(f"{where}: heads [{lo}, {hi}) arrived twice: every head of every layer must "
                                   "arrive exactly once (the first copy stands)")
            self._claimed[a:b] = True
        return _Piece(self, meta, lo, hi)

    def _landed(self, p: _Piece) -> None:
        s, a, b = self.spec, p.lo - self.lo, p.hi - self.lo
        dst = self.blocks.reshape(self.n_blocks, s.num_layers, s.kv_factor, self.hi - self.lo, -1)
        dst[:, :, :, a:b] = p.buf.reshape(self.n_blocks, s.num_layers, s.kv_factor, b - a, -1)
        with self._cond:
            self._done[a:b] = True
            self._keys[(p.lo, p.hi)] = p.meta.block_keys
            self.wire_bytes += p.buf.nbytes
            self._cond.notify_all()

    def _dropped(self, p: _Piece) -> None:
        with self._cond:
            self._claimed[p.lo - self.lo : p.hi - self.lo] = False  # a retry may bring them
            self._cond.notify_all()

    @property
    def complete(self) -> bool:
        with self._cond:
            return bool(self._done.all())

    def missing(self) -> list[tuple[int, int]]:
        """The head ranges not in yet, as ``[lo, hi)`` of the model's heads."""
        with self._cond:
            out: list[tuple[int, int]] = []
            for i in np.flatnonzero(~self._done).tolist():
                h = self.lo + i
                if out and out[-1][1] == h:
                    out[-1] = (out[-1][0], h + 1)
                else:
                    out.append((h, h + 1))
            return out

    def wait(self, timeout_s: float, keys_for: KeysFor | None = None) -> np.ndarray:
        """The assembled blocks once every head is in (``[n_blocks, bytes_per_block]``, LKHTD of this
        rank's spec); ReshardError naming the missing heads at ``timeout_s``, or naming the piece
        whose keys are not the request's tokens (``keys_for``: its keys under a piece's spec)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._done.all()), timeout_s):
                raise ReshardError(f"request {self.request_id[:40]!r}: heads {self.missing()} of "
                                   f"[{self.lo}, {self.hi}) never arrived within {timeout_s:g} s")
            pieces = dict(self._keys)
        if keys_for is not None:
            for (lo, hi), keys in sorted(pieces.items()):
                want = tuple(keys_for(self.spec.heads(lo, hi)))
                if want != keys:
                    raise ReshardError(f"request {self.request_id[:40]!r}: the block keys of heads [{lo}, {hi}) "
                                       "are not this request's tokens: not linked")
        return self.blocks


class Assemblies:
    """A DestinationFactory for a receiver that re-shards (``Receiver(reshard=True)``): one
    :class:`HeadAssembly` per request id, opened by its first piece, handed out by :meth:`take`.
    Bounded: ``max_pending`` requests and ``max_bytes`` of blocks at once (a piece past either is
    refused: TierFullError); one nobody took ``ttl_s`` after its first piece is dropped."""

    def __init__(self, spec: KVSpec, *, max_pending: int = MAX_PENDING, max_bytes: int = MAX_BYTES,
                 ttl_s: float = TTL_S) -> None:
        self.spec, self.max_pending, self.max_bytes, self.ttl_s = spec, max_pending, max_bytes, ttl_s
        self._open: dict[str, HeadAssembly] = {}
        self._cond = threading.Condition()

    def __call__(self, meta: TransferMeta) -> _Piece:
        with self._cond:
            asm = self._open.get(meta.request_id)
            if asm is None:
                now = time.monotonic()
                for rid in [r for r, a in self._open.items() if now - a.t_first > self.ttl_s]:
                    del self._open[rid]
                need = 2 * meta.n_blocks * self.spec.bytes_per_block
                held = sum(a.nbytes for a in self._open.values())
                if len(self._open) >= self.max_pending or held + need > self.max_bytes:
                    raise TierFullError(f"re-shard: {len(self._open)} requests ({held} B) pending, the cap is "
                                        f"{self.max_pending} ({self.max_bytes} B)")
                asm = HeadAssembly(self.spec, meta.request_id, meta.n_blocks, meta.token_start)
                self._open[meta.request_id] = asm
                self._cond.notify_all()
        return asm.piece(meta)

    def take(self, request_id: str, timeout_s: float, keys_for: KeysFor | None = None) -> HeadAssembly:
        """The request's assembly once complete (and its keys checked), no longer held here;
        ReshardError at ``timeout_s`` (the caller recomputes; its pieces are dropped)."""
        end = time.monotonic() + timeout_s
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._open, timeout_s):
                lo, hi = self.spec.head_range
                raise ReshardError(f"request {request_id[:40]!r}: heads [({lo}, {hi})] of [{lo}, {hi}) never "
                                   f"arrived within {timeout_s:g} s (no piece came)")
            asm = self._open[request_id]
        try:
            asm.wait(max(0.0, end - time.monotonic()), keys_for)
        finally:
            self.discard(request_id)
        return asm

    def discard(self, request_id: str) -> None:
        with self._cond:
            self._open.pop(request_id, None)

    def __len__(self) -> int:
        with self._cond:
            return len(self._open)


__all__ = ["Assemblies", "HeadAssembly", "KeysFor", "piece_for", "piece_keys", "split"]
