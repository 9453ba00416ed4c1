"""kvport.memops: the native kernels give exactly the fallback's results, on awkward sizes and
alignments, on every thread count, and refuse out-of-bounds chunks before copying anything."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvport import memops


def _case(seed: int, sizes: list[int], align: int) -> tuple[np.ndarray, list[memoryview], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, sum(sizes) + 4096, dtype=np.uint8)
    dst = np.zeros(sum(sizes) + 64 * len(sizes) + align, dtype=np.uint8)
    offsets = rng.permutation(np.cumsum([0, *sizes[:-1]])).astype(np.uint64)  # chunks out of order
    dm = dst.data.cast("B")
    views, at = [], align  # destinations deliberately misaligned by ``align`` bytes
    for n in sizes:
        views.append(dm[at : at + n])
        at += n + 64
    return src, views, offsets, dst


SIZES = [1, 63, 64, 65, 4096, 16 << 10, (16 << 10) + 7, 64 << 10, 100_003, 1 << 20]


def test_xxh3_many_matches_python_xxhash() -> None:
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES] + [b""]
    want = b"".join(xxhash.xxh3_64_intdigest(b).to_bytes(8, "little") for b in bufs)
    assert memops.xxh3_many(bufs) == want == memops.xxh3_many_py(bufs)
    assert memops.xxh3_many([]) == b""


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("align", [0, 1, 13, 32])
def test_copy_verify_copies_exactly_and_flags_bad_digests(threads: int, align: int) -> None:
    src, views, offsets, _ = _case(threads * 100 + align, SIZES, align)
    sm = src.data.cast("B")
    want = bytearray(memops.xxh3_many([sm[o : o + v.nbytes] for o, v in zip(offsets.tolist(), views, strict=True)]))
    for i in (2, 7):  # two chunks whose announced digest is wrong
        want[8 * i] ^= 0x40
    assert memops.copy_verify(views, sm, offsets, bytes(want), threads) == [2, 7]
    for o, v in zip(offsets.tolist(), views, strict=True):  # every chunk copied, bad ones too
        assert bytes(v) == bytes(sm[o : o + v.nbytes])
    ref = [memoryview(bytearray(v.nbytes)) for v in views]
    assert memops.copy_verify_py(ref, sm, offsets, bytes(want)) == [2, 7]
    assert all(bytes(a) == bytes(b) for a, b in zip(ref, views, strict=True))


def test_copy_verify_many_chunks_across_groups() -> None:
    """More chunks than the native side holds buffers for at once (4096): indexes stay global."""
    n, lb = 5000, 256
    src = np.random.default_rng(5).integers(0, 256, n * lb, dtype=np.uint8)
    dst = np.zeros_like(src)
    sm, dm = src.data.cast("B"), dst.data.cast("B")
    offsets = np.arange(n, dtype=np.uint64) * lb
    want = bytearray(memops.xxh3_many([sm[i * lb : (i + 1) * lb] for i in range(n)]))
    want[8 * 4500] ^= 1
    assert memops.copy_verify([dm[i * lb : (i + 1) * lb] for i in range(n)], sm, offsets, bytes(want), 2) == [4500]
    assert np.array_equal(src, dst)


def test_copy_verify_refuses_out_of_bounds_before_copying() -> None:
    src = np.ones(1000, dtype=np.uint8).data.cast("B")
    dst = np.zeros(300, dtype=np.uint8)
    views = [dst.data.cast("B")[:100], dst.data.cast("B")[100:300]]
    want = memops.xxh3_many([src[:100], src[:200]])
    with pytest.raises(ValueError, match="outside"):
        memops.copy_verify(views, src, np.array([0, 900], dtype=np.uint64), want, 2)
    with pytest.raises(ValueError, match="outside"):
        memops.copy_verify(views, src, np.array([0, 2**63], dtype=np.uint64), want, 1)
    assert not dst.any()  # nothing copied, not even the chunk that was in bounds
    with pytest.raises(ValueError, match="offsets"):
        memops.copy_verify(views, src, np.array([0], dtype=np.uint64), want, 1)


def test_copy_verify_needs_writable_destinations() -> None:
    src = np.ones(64, dtype=np.uint8).data.cast("B")
    want = memops.xxh3_many([src])
    with pytest.raises((TypeError, BufferError)):
        memops.copy_verify([memoryview(bytes(64))], src, np.zeros(1, dtype=np.uint64), want, 1)


def test_native_kernels_are_built_where_the_machine_allows() -> None:
    """`make setup` installs xxhash.h and builds kvport._memops; a silent fallback would only show
    as a slower benchmark, so this machine kind must have the native kernels."""
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not (Path("/usr/include/xxhash.h").exists() and shutil.which("gcc") and "avx512bw" in cpu):
        pytest.skip("no xxhash.h, compiler or AVX-512 here: kvport.memops runs its fallbacks")
    assert memops.NATIVE
