"""PagedTier (values over pages of a host pool or a disk) and its journal."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvport.errors import BlockNotFoundError, CorruptBlockError, TierError, TierFullError
from kvport.lifetime import Lifetime
from kvport.tiers.base import BlockMeta
from kvport.tiers.disk import DiskTier
from kvport.tiers.host import HostTier
from kvport.tiers.journal import JOURNAL_FILE, Journal, encode_add, encode_del, replay
from kvport.tiers.paged_tier import PagedTier, page_keys

P = 64


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_values_span_pages_and_come_back_whole() -> None:
    t = PagedTier(HostTier(8 * P, P), P)
    t.put(k(1), bytes(range(150)))
    assert t.size_of(k(1)) == 150 and t.charge(150) == 3 * P and t.used_bytes == 3 * P
    out = bytearray(200)
    assert t.get_into(k(1), out) == 150 and out[:150] == bytes(range(150))
    views = t.read_views(k(1))
    assert [v.nbytes for v in views] == [64, 64, 22] and b"".join(views) == bytes(range(150))
    with pytest.raises(TierError):
        t.view(k(1))  # several pages: read_views
    with pytest.raises(TierFullError):
        t.put(k(2), bytes(6 * P))  # 6 pages, 5 free: all or nothing
    assert not t.contains(k(2)) and t.used_bytes == 3 * P
    assert t.delete(k(1)) and t.used_bytes == 0


def test_reserve_is_invisible_until_commit_and_abort_leaves_nothing() -> None:
    t = PagedTier(HostTier(4 * P, P), P)
    views = t.reserve_views(k(1), 100)
    assert [v.nbytes for v in views] == [64, 36] and not t.contains(k(1))
    views[0][:] = b"a" * 64
    views[1][:] = b"b" * 36
    t.commit(k(1), BlockMeta(lifetime=Lifetime.SESSION))
    assert t.get(k(1)) == b"a" * 64 + b"b" * 36 and t.meta_of(k(1)).lifetime is Lifetime.SESSION  # type: ignore[union-attr]
    t.reserve_views(k(2), 2 * P)
    t.abort(k(2))
    assert not t.contains(k(2)) and t.used_bytes == 2 * P


def test_a_lost_page_is_a_corrupt_block_and_then_a_clean_miss(tmp_path: Path) -> None:
    inner = DiskTier(tmp_path / "blocks", 1 << 20)
    t = PagedTier(inner, P, journal=Journal(tmp_path))
    t.put(k(1), bytes(3 * P))
    inner.delete(page_keys(k(1), 3)[1])
    with pytest.raises(CorruptBlockError):
        t.get_into(k(1), bytearray(3 * P))
    with pytest.raises(BlockNotFoundError):
        t.get_into(k(1), bytearray(3 * P))
    t.close()


def test_restart_rebuilds_values_from_the_journal_and_quarantines_unaccounted_pages(tmp_path: Path) -> None:
    t = PagedTier(DiskTier(tmp_path / "blocks", 1 << 20), P, journal=Journal(tmp_path))
    t.put_block(k(1), [bytes(100)], BlockMeta(parent=None, lifetime=Lifetime.PREFIX, account="a", attrs=b"x"))
    t.put_block(k(2), [bytes(10)], BlockMeta(parent=k(1), account="a"))
    t.put(k(3), bytes(10))
    t.delete(k(3))
    t.close()
    t2 = PagedTier(DiskTier(tmp_path / "blocks", 1 << 20), P, journal=Journal(tmp_path))
    recs = {key: (n, m) for key, n, m in t2.records()}
    assert set(recs) == {k(1), k(2)} and recs[k(2)][1].parent == k(1) and recs[k(1)][1].attrs == b"x"  # type: ignore[union-attr]
    assert t2.quarantined == set()
    t2.close()
    (tmp_path / JOURNAL_FILE).unlink()  # the journal is lost: the pages are kept, reported, never deleted
    t3 = PagedTier(DiskTier(tmp_path / "blocks", 1 << 20), P, journal=Journal(tmp_path))
    assert list(t3.keys()) == [] and len(t3.quarantined) == 3
    assert set(t3.inner.keys()) == t3.quarantined
    t3.close()


def test_one_folder_one_process(tmp_path: Path) -> None:
    t = PagedTier(DiskTier(tmp_path / "blocks", 1 << 20), P, journal=Journal(tmp_path))
    with pytest.raises(TierError, match="in use by another process"):
        Journal(tmp_path)
    t.close()
    PagedTier(DiskTier(tmp_path / "blocks", 1 << 20), P, journal=Journal(tmp_path)).close()


def test_a_damaged_journal_record_loses_that_record_only() -> None:
    recs = [encode_add(k(i), 10 * i, BlockMeta(account="a")) for i in range(1, 6)] + [encode_del(k(2))]
    data = bytearray(b"".join(recs))
    off = len(recs[0]) + 20  # a byte inside record 2's body
    data[off] ^= 0xFF
    out = replay(bytes(data))
    assert set(out.live) == {k(1), k(3), k(4), k(5)} and out.skipped_bytes > 0
    torn = replay(b"".join(recs)[:-5])  # a torn tail (crash mid-append): only the last record is lost
    assert set(torn.live) == {k(1), k(2), k(3), k(4), k(5)}
