"""Re-shard between TP widths over the real hand-off (authenticated loopback TCP): the heads of
senders of another width assembled exactly once each, every byte on the wire once, nothing handed
out before every head of every layer is in; a duplicate, a missing, a foreign or a mis-keyed piece is
refused with the field or the heads named (the caller recomputes)."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from kvport.errors import IncompatibleSpecError, ReshardError, SpecError, TransferError
from kvport.keys import KeyContext, chain_keys, head_keys
from kvport.spec import DType, KVSpec
from kvport.transfer import BlockTableDestination, TransferMeta
from kvport.transfer.handoff import HandoffDialer, HandoffListener
from kvport.transfer.reshard import Assemblies, piece_for, piece_keys, split

FULL = KVSpec(model_id="m", num_layers=3, num_kv_heads=6, head_dim=8, dtype=DType.FP16, block_size=4)
N = 5
TOKENS = np.arange(N * FULL.block_size, dtype=np.int64) + 7


def _keys(spec: KVSpec, tokens: np.ndarray = TOKENS) -> tuple[bytes, ...]:
    return tuple(piece_keys(tokens, spec))


def _blocks(spec: KVSpec, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (N, spec.bytes_per_block), dtype=np.uint8)


def _heads(blocks: np.ndarray, spec: KVSpec) -> np.ndarray:
    """[n, layers, kv, heads, tokens*dim*itemsize]: the blocks' bytes by head."""
    return blocks.reshape(N, spec.num_layers, spec.kv_factor, spec.kv_heads_per_rank, -1)


@pytest.fixture()
def secret() -> bytes:
    return secrets.token_bytes(32)


class Decode:
    """One decode rank: a re-sharding listener into Assemblies."""

    def __init__(self, spec: KVSpec, secret: bytes, **kw: object) -> None:
        self.spec = spec
        self.asms = Assemblies(spec, **kw)  # type: ignore[arg-type]
        self.listener = HandoffListener("127.0.0.1:0", secret, spec, self.asms, reshard=True)

    def take(self, rid: str = "r", timeout_s: float = 10.0) -> np.ndarray:
        keys_for = lambda ps: _keys(ps)  # noqa: E731
        return self.asms.take(rid, timeout_s, keys_for=keys_for).blocks

    def close(self) -> None:
        self.listener.close()


def _send(secret: bytes, src: KVSpec, blocks: np.ndarray, dst: Decode, rid: str = "r",
          tokens: np.ndarray = TOKENS, piece: KVSpec | None = None) -> int:
    """One prefill rank's share for ``dst``: the heads both hold, split out and sent once."""
    piece = piece or piece_for(src, dst.spec)
    assert piece is not None
    part = split(blocks, src, piece)
    dialer = HandoffDialer(secret, [dst.listener.address])
    try:
        s = dialer.sender(dst.listener.address)
        h = s.send(TransferMeta(piece, rid, _keys(piece, tokens)), lambda la: [part[i, la].data for i in range(N)])
        s.close()
        return h.sent_bytes
    finally:
        dialer.close()


def test_a_piece_names_the_heads_of_a_rank_that_holds_exactly_them() -> None:
    assert FULL.heads(2, 4) == FULL.for_rank(1, 3)
    assert FULL.heads(0, 6) == FULL
    assert FULL.for_rank(1, 2).shared_heads(FULL.for_rank(2, 3)) == (4, 6)
    assert FULL.for_rank(0, 2).shared_heads(FULL.for_rank(2, 3)) is None
    assert piece_for(FULL.for_rank(1, 2), FULL.for_rank(1, 3)) == FULL.heads(3, 4)
    for lo, hi in ((1, 3), (0, 4), (5, 7)):  # not what one rank of a width holds
        with pytest.raises(SpecError, match="heads"):
            FULL.heads(lo, hi)
    # a key names its heads: the whole model's chain, keyed for the range (every head: the chain itself)
    whole = chain_keys(TOKENS, KeyContext(FULL.block_size, FULL.fingerprint))
    assert list(_keys(FULL)) == whole
    assert list(_keys(FULL.heads(2, 4))) == head_keys(whole, 2, 4, 6) != list(_keys(FULL.heads(0, 2)))
    assert _keys(FULL.for_rank(1, 3)) == _keys(FULL.for_rank(2, 6).heads(2, 4))  # same heads, same keys


def test_three_senders_assemble_one_rank_bit_exact_each_byte_once(secret: bytes) -> None:
    d = Decode(FULL, secret)  # TP=1 receives from TP=3
    try:
        full = _blocks(FULL)
        sent = 0
        for r in (2, 0, 1):  # any order
            src = FULL.for_rank(r, 3)
            sent += _send(secret, src, split(full, FULL, src), d)
        got = d.take()
        assert np.array_equal(got, full)
        assert sent == N * FULL.bytes_per_block  # bytes on the wire = the KV's size
    finally:
        d.close()


def test_one_sender_splits_for_three_receivers_and_two_for_three(secret: bytes) -> None:
    full = _blocks(FULL, seed=1)
    ranks = [Decode(FULL.for_rank(r, 3), secret) for r in range(3)]
    try:
        for src in (FULL.for_rank(0, 2), FULL.for_rank(1, 2)):  # TP=2 -> TP=3: rank 1 gets a head from each
            mine = split(full, FULL, src)
            for dst in ranks:
                if piece_for(src, dst.spec) is not None:
                    _send(secret, src, mine, dst)
        for r, dst in enumerate(ranks):
            assert np.array_equal(dst.take(), split(full, FULL, FULL.for_rank(r, 3)).reshape(N, -1))
    finally:
        for dst in ranks:
            dst.close()


def test_nothing_is_handed_out_while_a_head_is_missing_and_the_missing_heads_are_named(secret: bytes) -> None:
    d = Decode(FULL, secret)
    try:
        full = _blocks(FULL)
        for r in (0, 2):
            src = FULL.for_rank(r, 3)
            _send(secret, src, split(full, FULL, src), d)
        with pytest.raises(ReshardError, match=r"heads \[\(2, 4\)\] of \[0, 6\) never arrived"):
            d.take(timeout_s=0.5)
        assert len(d.asms) == 0  # the pieces that came are dropped with it: nothing half-assembled stays
    finally:
        d.close()


def test_a_head_that_arrives_twice_is_refused_and_the_first_copy_stands(secret: bytes) -> None:
    d = Decode(FULL, secret)
    try:
        full, other = _blocks(FULL), _blocks(FULL, seed=9)
        src = FULL.for_rank(1, 3)
        _send(secret, src, split(full, FULL, src), d)
        with pytest.raises(ReshardError, match=r"heads \[2, 4\) arrived twice"):
            _send(secret, src, split(other, FULL, src), d)
        for r in (0, 2):
            s = FULL.for_rank(r, 3)
            _send(secret, s, split(full, FULL, s), d)
        assert np.array_equal(d.take(), full)
    finally:
        d.close()


def test_heads_of_another_prompt_under_the_same_request_are_never_linked(secret: bytes) -> None:
    d = Decode(FULL, secret)
    try:
        full = _blocks(FULL)
        for r in range(3):
            src = FULL.for_rank(r, 3)
            tokens = TOKENS if r != 1 else TOKENS[::-1].copy()  # one rank prefilled another prompt
            _send(secret, src, split(full, FULL, src), d, tokens=tokens)
        with pytest.raises(ReshardError, match=r"block keys of heads \[2, 4\) are not this request's tokens"):
            d.take()
    finally:
        d.close()


def test_heads_a_rank_does_not_hold_are_refused_naming_head_range(secret: bytes) -> None:
    d = Decode(FULL.for_rank(0, 3), secret)  # heads [0, 2)
    try:
        src = FULL.for_rank(1, 3)  # heads [2, 4)
        with pytest.raises(IncompatibleSpecError, match="head_range"):
            _send(secret, src, _blocks(src), d, piece=src)
    finally:
        d.close()


def test_without_reshard_another_tp_width_is_refused_naming_tp_size(secret: bytes) -> None:
    dst = np.zeros((N, FULL.bytes_per_block), np.uint8)
    listener = HandoffListener("127.0.0.1:0", secret, FULL, lambda m: BlockTableDestination(dst, range(N), m))
    try:
        src = FULL.for_rank(0, 3)
        dialer = HandoffDialer(secret, [listener.address])
        s = dialer.sender(listener.address)
        part = _blocks(src)
        with pytest.raises(IncompatibleSpecError, match="tp_size"):
            s.send(TransferMeta(src, "r", _keys(src)), lambda la: [part[i, la * src.bytes_per_layer_block:][
                : src.bytes_per_layer_block].data for i in range(N)])
        dialer.close()
        assert not dst.any()
    finally:
        listener.close()


def test_another_model_field_is_refused_even_when_re_sharding(secret: bytes) -> None:
    d = Decode(FULL, secret)
    try:
        src = FULL.with_(head_dim=16).for_rank(0, 3)
        with pytest.raises(IncompatibleSpecError, match="head_dim"):
            _send(secret, src, _blocks(src), d, piece=src)
    finally:
        d.close()


def test_pending_assemblies_are_bounded(secret: bytes) -> None:
    d = Decode(FULL, secret, max_pending=1)
    try:
        full = _blocks(FULL)
        src = FULL.for_rank(0, 3)
        _send(secret, src, split(full, FULL, src), d, rid="a")
        with pytest.raises(TransferError, match="pending"):
            _send(secret, src, split(full, FULL, src), d, rid="b")
    finally:
        d.close()
