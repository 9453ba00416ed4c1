import errno
import itertools
import os

import numpy as np
import pytest

from kvport.errors import BlockNotFoundError, CorruptBlockError, TierFullError
from kvport.tiers import DiskTier

K1, K2 = b"1" * 16, b"2" * 16


def test_restart_keeps_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8)
    t = DiskTier(tmp_path, 1 << 20)
    t.put(K1, data)
    t.put(K2, b"small")
    t.close()
    t2 = DiskTier(tmp_path, 1 << 20)
    assert sorted(t2.keys()) == [K1, K2]
    assert t2.used_bytes == 100_005
    out = bytearray(100_000)
    assert t2.get_into(K1, out) == 100_000
    assert bytes(out) == data.tobytes()


def test_flipped_byte_is_corrupt_then_a_clean_miss(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = DiskTier(tmp_path, 1 << 20)
    t.put(K1, b"a" * 1000)
    p, off, _ = t.locate(K1)
    raw = bytearray(p.read_bytes())
    raw[off + 500] ^= 0xFF
    p.write_bytes(raw)
    out = bytearray(1000)
    with pytest.raises(CorruptBlockError):
        t.get_into(K1, out)
    assert not t.contains(K1)
    with pytest.raises(BlockNotFoundError):
        t.get_into(K1, out)


def test_truncated_file_is_corrupt_or_dropped_on_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = DiskTier(tmp_path, 1 << 20)
    t.put(K1, b"a" * 1000)
    t.put(K2, b"b" * 1000)
    for k in (K1, K2):
        p, off, n = t.locate(k)
        with open(p, "r+b") as f:
            f.truncate(off + n - 1)
    with pytest.raises(CorruptBlockError):
        t.get_into(K1, bytearray(1000))
    t2 = DiskTier(tmp_path, 1 << 20)  # restart: the truncated K2 is not adopted
    assert list(t2.keys()) == []


def test_enospc_is_tier_full_with_nothing_partial(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    t = DiskTier(tmp_path, 1 << 20)
    t.put(K1, b"old value")
    real = os.pwrite

    def full_disk(fd: int, data: object, offset: int) -> int:
        real(fd, b"partial", offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)  # a real full disk cannot be produced on demand
    with pytest.raises(TierFullError):
        t.put(K1, b"new value")
    with pytest.raises(TierFullError):
        t.put(K2, b"other")
    monkeypatch.undo()
    assert t.get(K1) == b"old value"
    assert not t.contains(K2)
    assert sorted(tmp_path.glob("*.kvs")) == [t.path_of(K1)]  # no partial slab became visible
    assert list((tmp_path / "tmp").iterdir()) == []


def test_capacity_is_enforced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = DiskTier(tmp_path, 100)
    t.put(K1, b"x" * 60)
    with pytest.raises(TierFullError):
        t.put(K2, b"y" * 60)
    t.put(K1, b"z" * 100)  # a replacement counts the old value as freed
    assert t.used_bytes == 100


def test_batch_is_one_slab_and_deleted_blocks_stay_deleted_after_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = DiskTier(tmp_path, 1 << 20)
    keys = [bytes([i]) * 16 for i in range(5)]
    t.put_many([(k, bytes([i]) * (100 + i)) for i, k in enumerate(keys)])
    assert t.slab_count == 1
    paths = {t.locate(k)[0] for k in keys}
    assert len(paths) == 1
    offs = sorted(t.locate(k)[1] for k in keys)
    assert all(b - a == 100 + i for i, (a, b) in enumerate(itertools.pairwise(offs)))  # back to back
    outs = [bytearray(200) for _ in keys]
    got = t.get_many_into(list(zip([*keys, b"z" * 16], [*outs, bytearray(1)], strict=True)))
    assert got == [100, 101, 102, 103, 104, None]
    assert all(bytes(o[: 100 + i]) == bytes([i]) * (100 + i) for i, o in enumerate(outs))
    assert t.delete(keys[1]) and t.delete(keys[3])
    t2 = DiskTier(tmp_path, 1 << 20)
    assert sorted(t2.keys()) == sorted([keys[0], keys[2], keys[4]])
    assert t2.used_bytes == 100 + 102 + 104
    for k in (keys[0], keys[2], keys[4]):
        t2.delete(k)
    assert t2.slab_count == 0 and list(tmp_path.glob("*.kvs")) == []


def test_checksum_covers_the_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = DiskTier(tmp_path, 1 << 20)
    t.put_many([(K1, b"same"), (K2, b"same")])
    p, _, _ = t.locate(K1)
    raw = bytearray(p.read_bytes())
    raw[16 : 16 + 16] = K2  # the first entry now claims to hold K2 ...
    raw[16 + 48 : 16 + 64] = K1  # ... and the second K1: same bytes, swapped keys
    p.write_bytes(raw)
    t2 = DiskTier(tmp_path, 1 << 20)
    assert t2.get_many_into([(K1, bytearray(4)), (K2, bytearray(4))]) == [None, None]


def test_two_instances_sharing_a_folder_see_each_others_writes_and_removals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = DiskTier(tmp_path, 1 << 20)
    b = DiskTier(tmp_path, 1 << 20, refresh_s=None)  # opened before a writes: only an explicit refresh
    a.put_many([(b"k" * 16, b"x" * 100), (b"j" * 16, b"y" * 50)])
    assert not b.contains(b"k" * 16)
    assert b.refresh() == 2 and b.refresh() == 0  # the second scan is one stat: nothing moved
    out = bytearray(100)
    assert b.get_into(b"k" * 16, out) == 100 and bytes(out) == b"x" * 100
    a.delete(b"k" * 16)
    a.delete(b"j" * 16)  # the slab is empty now: a unlinks it
    b.refresh()
    assert not b.contains(b"j" * 16) and b.used_bytes == 0
    with pytest.raises(BlockNotFoundError):
        b.get_into(b"j" * 16, bytearray(50))


def test_a_miss_rescans_by_itself_and_nothing_is_indexed_twice(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = DiskTier(tmp_path, 1 << 20)
    b = DiskTier(tmp_path, 1 << 20, refresh_s=0.0)
    a.put(b"k" * 16, b"z" * 64)
    assert b.contains(b"k" * 16)  # the miss rescanned the folder
    b.put(b"m" * 16, b"w" * 32)
    assert b.refresh() == 0  # its own slab was indexed by put, not taken for a stranger's
    assert b.used_bytes == 96 and sorted(b.keys()) == [b"k" * 16, b"m" * 16]


def test_temporary_files_of_live_writers_survive_another_open(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    DiskTier(tmp_path, 1 << 20)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    live = tmp_path / "tmp" / f"{os.getpid():x}-abc-1-00.kvs"
    gone = tmp_path / "tmp" / f"{int(dead.stdout):x}-abc-1-00.kvs"
    live.write_bytes(b"partial")
    gone.write_bytes(b"partial")
    DiskTier(tmp_path, 1 << 20)
    assert live.exists() and not gone.exists()


@pytest.mark.parametrize("parallel", [True, False])
def test_large_batches_hashed_beside_the_write_store_the_same_checksums(tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                       parallel: bool) -> None:
    from kvport.tiers import disk as disk_mod

    monkeypatch.setattr(disk_mod, "PARALLEL_HASH_MIN_BYTES", 1 if parallel else 1 << 62)
    rng = np.random.default_rng(5)
    vals = [rng.integers(0, 256, n, dtype=np.uint8) for n in (3 << 20, 1 << 20, 5000)]
    keys = [bytes([i]) * 16 for i in range(3)]
    DiskTier(tmp_path, 1 << 26).put_many(list(zip(keys, vals, strict=True)))
    again = DiskTier(tmp_path, 1 << 26)  # restart: every entry's checksum is verified on read
    for k, v in zip(keys, vals, strict=True):
        assert again.get(k) == v.tobytes()
    digests = [again._index[k].digest for k in keys]
    import xxhash

    assert digests == [xxhash.xxh3_64_intdigest(k + v.tobytes()) for k, v in zip(keys, vals, strict=True)]


def test_a_write_failing_beside_the_hasher_leaves_nothing_and_waits_for_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kvport.tiers import disk as disk_mod

    monkeypatch.setattr(disk_mod, "PARALLEL_HASH_MIN_BYTES", 1)
    hashed: list[int] = []
    real_digests = disk_mod._digests

    def slow_digests(keys, srcs):  # type: ignore[no-untyped-def]
        import time

        time.sleep(0.2)  # still hashing when the write fails
        out = real_digests(keys, srcs)
        hashed.append(len(out))
        return out

    def full_disk(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod, "_digests", slow_digests)
    monkeypatch.setattr(os, "pwrite", full_disk)
    monkeypatch.setattr(os, "pwritev", full_disk)
    t = DiskTier(tmp_path, 1 << 26)
    with pytest.raises(TierFullError):
        t.put_many([(K1, b"x" * 100_000), (K2, b"y" * 100_000)])
    assert hashed == [2]  # put_many returned only after the hasher let go of the caller's buffers
    monkeypatch.undo()
    assert not t.contains(K1) and not t.contains(K2)
    assert list(tmp_path.glob("*.kvs")) == [] and list((tmp_path / "tmp").iterdir()) == []


def test_short_vectored_writes_continue_where_they_stopped(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kvport.tiers import disk as disk_mod

    monkeypatch.setattr(disk_mod, "PARALLEL_HASH_MIN_BYTES", 1)
    real = os.pwritev

    def short(fd: int, views: list[memoryview], offset: int) -> int:  # at most 1000 bytes, mid-view
        left, out = 1000, []
        for v in views:
            out.append(v[:left])
            left -= out[-1].nbytes
            if not left:
                break
        return real(fd, out, offset)

    monkeypatch.setattr(os, "pwritev", short)
    vals = [bytes([i]) * (2500 + i) for i in range(5)] + [b"", b""]  # empty values at the end too
    keys = [bytes([i]) * 16 for i in range(7)]
    DiskTier(tmp_path, 1 << 20).put_many(list(zip(keys, vals, strict=True)))
    monkeypatch.undo()
    again = DiskTier(tmp_path, 1 << 20)
    assert [again.get(k) for k in keys] == vals
