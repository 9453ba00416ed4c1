"""kvport.memops: every native kernel set that runs here (avx512, avx2, portable) gives exactly the
fallback's results, on awkward sizes and alignments, on every thread count, and refuses
out-of-bounds chunks before copying anything; the widest set the CPU runs is the one in use."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
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
KERNELS = ("avx512", "avx2", "portable")
NEEDS = {"avx512": ("avx2", "avx512f", "avx512bw"), "avx2": ("avx2",), "portable": ()}


@pytest.fixture(params=KERNELS)
def kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each native kernel set this CPU runs, in turn (the tests then compare it with the fallbacks)."""
    name = str(request.param)
    if name not in memops.paths():
        pytest.skip(f"the {name} kernels do not run here (or kvport._memops is not built)")
    memops.use(name)
    try:
        yield name
    finally:
        memops.use(str(memops.PATH))


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def test_xxh3_many_matches_python_xxhash(kernels: str) -> None:
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in SIZES] + [b""]
    want = b"".join(xxhash.xxh3_64_intdigest(b).to_bytes(8, "little") for b in bufs)
    assert memops.xxh3_many(bufs) == want == memops.xxh3_many_py(bufs)
    assert memops.xxh3_many([]) == b""


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("align", [0, 1, 13, 32])
def test_copy_verify_copies_exactly_and_flags_bad_digests(threads: int, align: int, kernels: str) -> None:
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


def test_copy_verify_many_chunks_across_groups(kernels: str) -> None:
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


def test_native_kernels_are_built_and_the_widest_the_cpu_runs_is_used() -> None:
    """`make setup` installs xxhash.h and builds kvport._memops, on any CPU (a portable set needs no
    instruction of its own); a silent fallback would only show as a slower benchmark."""
    if not (Path("/usr/include/xxhash.h").exists() and shutil.which("gcc")):
        pytest.skip("no xxhash.h or compiler here: kvport.memops runs its fallbacks")
    assert memops.NATIVE
    have = _cpu_flags()
    runs = [k for k in KERNELS if all(f in have for f in NEEDS[k])]
    if platform.machine() in ("x86_64", "AMD64"):
        assert memops.paths() == runs  # every set of the build that this CPU runs, widest first
    assert memops.paths()[0] == memops.PATH and "portable" in memops.paths()


def test_a_kernel_set_that_cannot_run_here_is_refused() -> None:
    if not memops.NATIVE:
        with pytest.raises(ValueError, match="not built"):
            memops.use("portable")
        return
    with pytest.raises(ValueError, match="no kernels named"):
        memops.use("sse9")
    missing = [k for k in KERNELS if k not in memops.paths()]
    for k in missing:
        with pytest.raises(ValueError, match="do not run on this CPU"):
            memops.use(k)
    assert memops.path() == memops.PATH  # a refused choice changes nothing


def _path_in_child(value: str) -> tuple[str, str]:
    env = {**os.environ, "KVPORT_MEMOPS": value}
    out = subprocess.run([sys.executable, "-c", "from kvport import memops; print(memops.PATH)"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip(), out.stderr


def test_kvport_memops_picks_the_kernels_of_a_process_tree() -> None:
    """A benchmark of the AVX2 set on an AVX-512 machine, or of the fallbacks, runs every process it
    spawns on them: the variable, not a call, picks them."""
    if not memops.NATIVE:
        pytest.skip("kvport._memops not built here")
    for k in memops.paths():
        assert _path_in_child(k)[0] == k
    assert _path_in_child("fallback")[0] == "None"
    got, err = _path_in_child("sse9")  # not a set that runs here: a warning naming it, the default kept
    assert got == memops.paths()[0] and "KVPORT_MEMOPS=sse9" in err


CROSS_CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")


@pytest.mark.skipif(not (CROSS_CC and QEMU and Path("/usr/include/xxhash.h").exists()),
                    reason="no aarch64 cross compiler (gcc-aarch64-linux-gnu) or qemu-user here")
def test_the_portable_kernels_built_for_aarch64_give_xxhash_digests_and_exact_copies(tmp_path: Path) -> None:
    """The portable set is the one an aarch64 host (Grace) runs: cross-built by Debian's compiler,
    run under qemu-user, it must give python-xxhash's digests and copy every byte."""
    here = Path(__file__).parent
    src_dir = here.parent / "src" / "kvport"
    inc = tmp_path / "include"
    inc.mkdir()
    shutil.copy("/usr/include/xxhash.h", inc)  # header-only (XXH_INLINE_ALL): no x86 headers beside it
    exe = tmp_path / "kernels_check"
    driver = here / "native" / "kernels_check.c"
    subprocess.run([str(CROSS_CC), "-O2", "-static", f"-I{src_dir}", f"-I{inc}", str(driver),
                    str(src_dir / "_memops_portable.c"), "-o", str(exe)], check=True, capture_output=True, timeout=300)
    out = subprocess.run([str(QEMU), str(exe)], check=True, capture_output=True, text=True, timeout=300).stdout
    rows = [line.split() for line in out.splitlines()]
    assert len(rows) == 11
    for size, h, c, equal in rows:
        i = np.arange(int(size), dtype=np.uint64)
        data = ((131 * i + 7 * (i >> np.uint64(8)) + 17) % 256).astype(np.uint8).tobytes()
        want = f"{xxhash.xxh3_64_intdigest(data):016x}"
        assert (h, c, equal) == (want, want, "1"), f"size {size}"
