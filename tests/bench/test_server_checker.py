"""The server bench's integrity check: it must catch a wrong byte wherever it is, however the
ranges were reported (whole pieces by digest, partial pieces and unreported bytes by memcmp)."""

from __future__ import annotations

import numpy as np
import pytest

from kvport.bench.server import _PIECE, _Checker, _Pool

POOL = 8 * _PIECE


@pytest.fixture(scope="module")
def pool() -> _Pool:
    return _Pool.make(POOL)


def _value(pool: _Pool, off: int, n: int) -> np.ndarray:
    out = np.zeros(4 * _PIECE, dtype=np.uint8)
    out[:n] = pool.data[off : off + n]
    return out


@pytest.mark.parametrize("ranges", ["pieces", "one", "gap", "none"])
@pytest.mark.parametrize("flip", [None, 10, _PIECE + 5, 2 * _PIECE + 100])
def test_checker_accepts_exact_values_and_catches_any_wrong_byte(pool: _Pool, ranges: str, flip: int | None) -> None:
    off, n = 2 * _PIECE, 2 * _PIECE + 1000  # two whole pieces and a partial one
    out = _value(pool, off, n)
    if flip is not None:
        out[flip] ^= 0x40
    c = _Checker(pool, out)
    c.start(off)
    if ranges == "pieces":
        for lo in range(0, n, _PIECE):
            c.range(lo, min(_PIECE, n - lo))
    elif ranges == "one":
        c.range(0, n)
    elif ranges == "gap":  # the middle piece never reported: checked by memcmp at the end
        c.range(0, _PIECE)
        c.range(2 * _PIECE, n - 2 * _PIECE)
    assert c.finish(n) is (flip is None)


def test_a_retry_reports_again_from_zero_and_is_checked_afresh(pool: _Pool) -> None:
    off, n = 0, 3 * _PIECE
    out = _value(pool, off, n)
    c = _Checker(pool, out)
    c.start(off)
    saved = int(out[_PIECE + 1])
    out[_PIECE + 1] ^= 1  # the first attempt landed a wrong byte, then the connection dropped
    c.range(0, 2 * _PIECE)
    out[_PIECE + 1] = saved  # the retry writes the value again from the start
    for lo in range(0, n, _PIECE):
        c.range(lo, _PIECE)
    assert c.finish(n)


def test_a_value_off_the_piece_grid_is_compared_byte_for_byte(pool: _Pool) -> None:
    off, n = _PIECE + 7, _PIECE + 3  # not on the grid: no digest applies
    out = _value(pool, off, n)
    c = _Checker(pool, out)
    c.start(off)
    c.range(0, n)
    assert c.finish(n)
    out[n - 1] ^= 1
    c.start(off)
    c.range(0, n)
    assert not c.finish(n)
