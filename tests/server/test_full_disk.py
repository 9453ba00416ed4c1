"""Against a real server process whose ``--disk`` is a small filesystem that fills up (a tmpfs of
8 MiB, or of 32 MiB where values are demoted into it; the disk tier is told 64 MiB): demotion,
refused writes and shutdown under ENOSPC, and a restart on the full disk. Needs root to mount;
skipped (with the reason) where mounting is not permitted.

What "lost" means for a cache: a value may leave, but only as the least recently used leaf of the
store. So, with values written in order and never read in between (the write order is the LRU
order), the unpinned plain values still held are always the *newest* ones; a pinned value, and a
block with cached children, never leave; every value held reads back exactly; and what the server
reported on disk before a restart is served after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvport.client.remote import RemoteTier
from kvport.errors import TierFullError
from kvport.protocol.rejects import Rejected, RejectReason

from .conftest import MiB, base_args

FS_BYTES = 8 * MiB
SPILL_FS_BYTES = 48 * MiB  # > 2 x the host pool of a 90 MiB server (11 MiB here, 18 MiB in a venv without torch)


@contextlib.contextmanager
def tmpfs(mnt: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted on ``mnt`` (created) meanwhile; the test is skipped without root."""
    mnt.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"cannot mount a {size >> 20} MiB tmpfs (needs root): {exc} {err.decode().strip()}")
    try:
        yield mnt
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "small-fs", FS_BYTES) as mnt:
        yield mnt


def value_of(key: bytes, n: int = MiB) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, n, dtype=np.uint8).tobytes()


def key_of(tag: str, i: int) -> bytes:
    return (tag.encode() + i.to_bytes(4, "little")).ljust(16, b".")


def server_args(disk: Path, capacity: str) -> list[str]:
    return [*base_args(capacity, "--disk", str(disk), "--disk-capacity", "64MiB"), "--max-value", "4MiB",
            "--inflight", "8MiB"]


def tiers_of(c: RemoteTier, keys: list[bytes]) -> dict[bytes, tuple[str, ...]]:
    """Where the server holds each of ``keys`` (absent keys are left out); touches nothing."""
    out: dict[bytes, tuple[str, ...]] = {}
    for i in range(0, len(keys), 64):
        for row in c.owners([*keys[i : i + 64], bytes(16)]).blocks:  # 2+ keys: no chain walk
            out[bytes.fromhex(row.key)] = tuple(row.tiers)
    return out


def reads_back(c: RemoteTier, key: bytes, n: int = MiB) -> bool:
    out = bytearray(n)
    return c.get_into(key, out) == n and bytes(out) == value_of(key, n)


def fill_up(fs: Path) -> None:
    """Another process's file takes every byte the filesystem has left."""
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for step in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, bytes(step)):
                    pass
    finally:
        os.close(fd)


def test_demotion_into_a_full_disk_loses_no_value_out_of_lru_order(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Values written in order onto a disk of 32 MiB, more than twice the host pool: first the
    disk fills with values demoted from host and drops its least recently used; then another file
    keeps taking every byte the store frees. While the disk's own victims can make room for the
    host pool (what a graceful shutdown moves down) the PUTs go on; once they cannot, every PUT is
    refused (``full``), never acknowledged and then lost. Throughout, the values still held are the
    newest ones, pinned values and the parents of a pinned block stay, no child outlives its parent
    and host values read back exactly; a value deleted while the disk is full stays deleted. Once
    the other file has given back room for the host pool, the PUTs are acknowledged again (the host's
    least recently used leave for them), and after SIGTERM and a restart every value still held,
    on host or on disk, is served."""
    with tmpfs(tmp_path / "fs", SPILL_FS_BYTES) as fs:
        disk = fs / "disk"
        srv = server_factory(*server_args(disk, "90MiB"))
        host_pages, disk_pages = srv.info["host_capacity"] // MiB, srv.info["disk_capacity"] // MiB
        assert 2 * host_pages < disk_pages, "the disk must hold the host pool and the values demoted from it"
        c = srv.client(pool_size=1, backpressure_timeout_s=0.0)  # a refusal comes back at once
        pinned = [key_of("pin", i) for i in range(3)]
        for k in pinned:
            c.put_value(k, value_of(k), pin=True)
        chain = [key_of("chain", i) for i in range(3)]  # its tail pinned: the parents never leave
        loose = [key_of("loose", i) for i in range(3)]  # not pinned: leaves go first, never a parent first
        for ks, pin_tail in ((chain, True), (loose, False)):
            for i, k in enumerate(ks):
                c.put_value(k, value_of(k), parent=ks[i - 1] if i else None, pin=pin_tail and i == len(ks) - 1)
        plain = [key_of("v", i) for i in range(disk_pages + 4 * host_pages)]
        full_from = disk_pages + host_pages  # the disk has filled by then: from here the other file takes the rest
        acked: list[bytes] = []
        refused: list[bytes] = []
        pinned_on_disk: list[bytes] = []
        for i, k in enumerate(plain):
            out = c.put_value(k, value_of(k))
            if isinstance(out, Rejected):
                assert out.reason is RejectReason.FULL, out
                refused.append(k)
                if len(refused) == 3:
                    break
            else:
                assert not refused, f"{k!r} acknowledged after a refusal, with the filesystem still full"
                acked.append(k)
            if i == full_from:
                where = tiers_of(c, acked)
                held = [k for k in acked if k in where]
                assert held == acked[len(acked) - len(held):], "a value left while an older one was kept"
                assert len(held) < len(acked), "the disk never filled up"
                assert [where[k] for k in held] == sorted((where[k] for k in held), key=lambda t: t != ("disk",)), \
                    f"a value on host is older than one demoted to disk: {[where[k] for k in held]}"
                pinned_on_disk = [k for k in held if where[k] == ("disk",)][:3]
                assert len(pinned_on_disk) == 3, f"too little reached the disk: {where}"
                assert c.pin(pinned_on_disk) == 3
            if i >= full_from:
                fill_up(fs)
        assert len(refused) == 3, "the store kept acknowledging writes it could not keep through a shutdown"
        assert len(acked) > full_from + 1, "no write was acknowledged after the disk's own victims made room"
        where = tiers_of(c, pinned + chain + loose + acked)
        for k in pinned + pinned_on_disk + chain:
            assert k in where, f"{k!r} left the store"
        kept = [k in where for k in loose]
        assert kept == sorted(kept, reverse=True), f"a child outlived its parent: {kept}"
        held = [k for k in acked if k in where and k not in pinned_on_disk]
        assert held == acked[len(acked) - len(held):], "a value left while an older one was kept"
        assert held, "every unpinned value left"
        assert not set(tiers_of(c, refused)), "a refused value is held"
        for k in pinned + chain + loose + acked:  # host values read back exactly (a disk read would promote it
            if where.get(k) == ("host",):          # and evict others: disk values are read after the restart)
                assert reads_back(c, k), f"{k!r} reads back wrong"
        gone = pinned_on_disk.pop()
        assert c.unpin([gone]) == 1 and c.delete(gone)  # with the disk full: the delete is recorded all the same
        with open(fs / "filler", "r+b") as f:  # the other file gives back three host pools' worth: room for
            f.truncate(max(0, os.fstat(f.fileno()).st_size - 3 * host_pages * MiB))  # every host value below
        # also where a value takes more of the filesystem than its bytes (a tmpfs of huge pages; with only
        # a host pool's worth, the host must shrink to what the disk can take: its new values leave again)
        late = [key_of("late", i) for i in range(2)]
        for k in late:
            assert not isinstance(c.put_value(k, value_of(k)), Rejected), "refused with room again"
        where = tiers_of(c, pinned + chain + loose + acked + late)
        st = os.statvfs(fs)
        assert all(k in where for k in late), \
            (f"an acknowledged value left at once: {[where.get(k) for k in late]}, {st.f_bavail * st.f_frsize} "
             f"bytes free, host {[k for k, t in where.items() if t == ('host',)]}")
        held_after = [k for k in acked if k in where and k not in pinned_on_disk]
        assert held_after == held[len(held) - len(held_after):], "a value left while an older one was kept"
        c.close()
        assert srv.stop(signal.SIGTERM) == 0
        srv2 = server_factory(*server_args(disk, "90MiB"))
        c = srv2.client(pool_size=1)
        after = tiers_of(c, pinned + chain + loose + acked + late + refused + [gone])
        missing = [k for k in where if k not in after]
        assert not missing, f"{len(missing)} of {len(where)} values held before the restart are gone"
        assert sorted(after) == sorted(where)
        for k in where:
            assert reads_back(c, k), f"{k!r} reads back wrong after the restart"
        c.close()


def test_shutdown_spill_goes_on_after_a_block_that_does_not_fit(server_factory, small_fs: Path) -> None:  # type: ignore[no-untyped-def]
    """Host blocks moved to disk at SIGTERM, newest first, after another file took the room they
    had when acknowledged (the one loss a check at PUT time cannot prevent): the newest (4 MiB)
    does not fit the 3.5 MiB left (ENOSPC); the older 1 MiB ones after it still do, and the restart
    finds them."""
    disk = small_fs / "disk"
    srv = server_factory(*server_args(disk, "120MiB"))
    c = srv.client(pool_size=1)
    small = [key_of("small", i) for i in range(3)]
    for k in small:
        c.put(k, value_of(k))
    big = key_of("big", 0)
    c.put(big, value_of(big, 4 * MiB))  # the newest: spilled first
    assert set(tiers_of(c, [*small, big]).values()) == {("host",)}
    c.close()
    leave_free(small_fs, 3 * MiB + MiB // 2)  # room for three 1 MiB slabs and the journal, not 4 MiB
    assert srv.stop(signal.SIGTERM) == 0
    srv2 = server_factory(*server_args(disk, "120MiB"))
    c = srv2.client(pool_size=1)
    after = tiers_of(c, [*small, big])
    assert sorted(after) == sorted(small) and set(after.values()) == {("disk",)}
    for k in small:
        assert reads_back(c, k)
    c.close()


def leave_free(fs: Path, nbytes: int) -> None:
    """Another process's file takes all the free space of ``fs`` but ``nbytes``."""
    st = os.statvfs(fs)
    with open(fs / "filler", "wb") as f:
        f.write(bytes(st.f_bavail * st.f_frsize - nbytes))


def test_a_put_the_disk_could_not_keep_through_a_shutdown_is_refused(server_factory, small_fs: Path) -> None:  # type: ignore[no-untyped-def]
    """``--disk-capacity`` 64 MiB on a filesystem of 8 MiB: the server says so at start and uses
    what the filesystem holds. With 3.5 MiB left free by another file, three 1 MiB values are
    acknowledged; a 4 MiB one, which a graceful shutdown could not move to disk beside them, is
    refused (TierFullError); every value acknowledged is served after SIGTERM and a restart."""
    disk = small_fs / "disk"
    srv = server_factory(*server_args(disk, "120MiB"))
    assert 0 < srv.info["disk_capacity"] <= FS_BYTES
    srv.err.seek(0)
    assert "is more than the filesystem" in srv.err.read().decode()
    leave_free(small_fs, 3 * MiB + MiB // 2)
    c = srv.client(pool_size=1, backpressure_timeout_s=0.5)
    small = [key_of("small", i) for i in range(3)]
    for k in small:
        c.put(k, value_of(k))
    big = key_of("big", 0)
    with pytest.raises(TierFullError):
        c.put(big, value_of(big, 4 * MiB))
    assert sorted(tiers_of(c, [*small, big])) == sorted(small)
    c.close()
    assert srv.stop(signal.SIGTERM) == 0
    srv2 = server_factory(*server_args(disk, "120MiB"))
    c = srv2.client(pool_size=1)
    after = tiers_of(c, [*small, big])
    assert sorted(after) == sorted(small) and set(after.values()) == {("disk",)}
    for k in small:
        assert reads_back(c, k)
    c.close()


def test_with_the_journal_full_a_put_is_refused_and_nothing_acknowledged_is_lost(  # type: ignore[no-untyped-def]
        server_factory, small_fs: Path) -> None:
    """The journal's filesystem (8 MiB) is full, the slabs' (32 MiB, mounted below it) is not: a
    PUT is refused (TierFullError) -- a value the disk cannot record would not survive a restart,
    and room made for it would cost the values already acknowledged. Once the journal has room
    again, a graceful restart serves every value acknowledged, none of those refused."""
    disk = small_fs / "disk"
    with tmpfs(disk / "blocks", 32 * MiB):
        srv = server_factory(*server_args(disk, "120MiB"))
        host_pages = srv.info["host_capacity"] // MiB
        c = srv.client(pool_size=1, backpressure_timeout_s=0.5)
        acked = [key_of("early", i) for i in range(2)]
        for k in acked:
            c.put(k, value_of(k))
        fill_up(small_fs)
        refused = 0
        for i in range(host_pages + 4):  # more than the host holds: room for them would have to be made
            k = key_of("late", i)
            try:
                c.put(k, value_of(k))
                acked.append(k)
            except TierFullError:
                refused += 1
        assert refused == host_pages + 4, f"{host_pages + 4 - refused} values acknowledged with the journal full"
        assert set(tiers_of(c, acked)) == set(acked)
        (small_fs / "filler").unlink()
        c.close()
        assert srv.stop(signal.SIGTERM) == 0
        srv2 = server_factory(*server_args(disk, "120MiB"))
        c = srv2.client(pool_size=1)
        after = tiers_of(c, [*acked, *(key_of("late", i) for i in range(host_pages + 4))])
        assert sorted(after) == sorted(acked)
        for k in acked:
            assert reads_back(c, k)
        c.close()
