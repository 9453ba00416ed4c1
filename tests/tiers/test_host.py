import numpy as np
import pytest

from kvport.errors import BlockNotFoundError, BufferMismatchError, TierError, TierFullError
from kvport.tiers import HostTier

K1, K2, K3 = b"1" * 16, b"2" * 16, b"3" * 16


def test_put_get_round_trip_records_length() -> None:
    t = HostTier(4 * 64, 64)
    t.put(K1, b"abc")
    t.put(K2, np.arange(64, dtype=np.uint8))
    assert t.size_of(K1) == 3
    dst = bytearray(64)
    assert t.get_into(K1, dst) == 3
    assert dst[:3] == b"abc"
    assert t.get(K2) == bytes(range(64))
    assert t.used_bytes == 2 * 64
    assert sorted(t.keys()) == [K1, K2]


def test_missing_key_and_bad_buffers_raise_before_writing() -> None:
    t = HostTier(2 * 16, 16)
    with pytest.raises(BlockNotFoundError):
        t.get_into(K1, bytearray(16))
    t.put(K1, b"x" * 10)
    dst = bytearray(b"?" * 9)
    with pytest.raises(BufferMismatchError):
        t.get_into(K1, dst)
    assert dst == b"?" * 9
    with pytest.raises(BufferMismatchError):
        t.get_into(K1, b"read-only buffer")
    with pytest.raises(BufferMismatchError):
        t.put(K2, b"y" * 17)  # larger than a page
    with pytest.raises(BufferMismatchError):
        t.put(K2, np.zeros((4, 4), dtype=np.uint8)[:, ::2])  # not contiguous


def test_pool_full_and_replace_reuses_pages() -> None:
    t = HostTier(2 * 8, 8)
    t.put(K1, b"a")
    t.put(K2, b"b")
    with pytest.raises(TierFullError):
        t.put(K3, b"c")
    assert t.delete(K2)
    t.put(K3, b"c")
    assert t.free_pages == 0
    with pytest.raises(TierFullError):
        t.put(K1, b"A")  # replacing still needs a free page first; the old value stays
    assert t.get(K1) == b"a"


def test_reserve_is_invisible_until_commit_and_abort_frees() -> None:
    t = HostTier(2 * 8, 8)
    mv = t.reserve(K1, 5)
    mv[:] = b"hello"
    assert not t.contains(K1)
    assert list(t.keys()) == []
    with pytest.raises(BlockNotFoundError):
        t.view(K1)
    t.commit(K1)
    assert bytes(t.view(K1)) == b"hello"
    assert t.view(K1).readonly
    t.reserve(K2, 8)
    assert t.free_pages == 0
    t.abort(K2)
    assert t.free_pages == 1 and not t.contains(K2)
    with pytest.raises(TierError):
        t.commit(K2)
    with pytest.raises(BufferMismatchError):
        t.reserve(K3, 9)


def test_view_is_zero_copy_into_the_pool() -> None:
    t = HostTier(8, 8)
    mv = t.reserve(K1, 4)
    mv[:] = b"abcd"
    t.commit(K1)
    v = t.view(K1)
    mv[0:1] = b"z"  # the receiver's view and the reader's view share memory
    assert bytes(v) == b"zbcd"


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text.split("[")[1].split("]")[0] if "[" in text else "unknown"


def _huge_kib_at(addr: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that contains ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_large_pool_is_backed_by_huge_pages_and_round_trips() -> None:
    t = HostTier(64 << 20, 1 << 20, pin=False)
    value = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    t.put(K1, value)
    view = t.view(K1)
    assert _huge_kib_at(np.frombuffer(view, dtype=np.uint8).ctypes.data) >= 2048
    dst = bytearray(1 << 20)
    assert t.get_into(K1, dst) == 1 << 20 and bytes(dst) == value.tobytes()
    t.close()


def test_a_growing_pool_is_resident_up_to_its_highest_page_and_keeps_data() -> None:
    page = 1 << 20
    tier = HostTier(256 * page, page, prefault=False, pin=False)
    assert tier.resident_bytes == 0  # mapped, nothing touched: an idle pool costs nothing
    tier.put(b"a", b"x" * 100)
    assert tier.resident_bytes == page
    keys = [bytes([i]) * 4 for i in range(40)]
    tier.put_many([(k, k * 8) for k in keys])
    assert tier.resident_bytes == 41 * page
    assert tier.get(b"a") == b"x" * 100 and all(tier.get(k) == k * 8 for k in keys)
    for k in keys:  # freed pages are reused first: refilling the same amount does not grow it
        tier.delete(k)
    tier.put_many([(k + b"!", k) for k in keys])
    assert tier.resident_bytes == 41 * page
    assert HostTier(4 * page, page, pin=False).resident_bytes == 4 * page  # the default: all of it at start
