"""Memory kernels of the hot paths: the native ones (:mod:`kvport._memops`, C, built at install time
when a compiler and Debian's ``libxxhash-dev`` are there) or numpy + python-xxhash fallbacks that
give the same results, slower. The native kernels exist once per instruction set and the widest
the CPU runs is used (:data:`PATH`: ``avx512``, ``avx2`` or ``portable``, the last for any CPU;
``None`` on the fallbacks); :func:`paths` and :func:`use` name and pick the others (tests, benchmarks),
and the environment variable ``KVPORT_MEMOPS`` picks them for a whole process tree.

- :func:`xxh3_many`: the xxh3-64 digest of each buffer, packed u64 little-endian (the wire's chunk
  trailers), in one call with the GIL released.
- :func:`spans`: the address and length of many buffers in one call.
- :func:`copy_verify`: copy chunks out of one source buffer (a peer's registered shared memory)
  into the caller's buffers and say which ones do not match their expected digest. Native: what is
  hashed is exactly what was written, the stores bypass the cache, and the chunks are split over
  ``threads`` threads (``kvport bench transfer`` measures it against memcpy of the same bytes).

Errors are ``ValueError`` (a length or offset outside the source); callers map them into kvport's
exception tree at their boundary.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import xxhash

from kvport.config import memops_choice

_native: ModuleType | None
try:
    from kvport import _memops as _native
except ImportError:  # not built here (no compiler or no xxhash.h at install): the fallbacks below
    _native = None
if _native is not None and not hasattr(_native, "path"):  # a build older than the dispatch (doctor says so)
    _native = None


# the CPU features each of kvport._memops's kernel sets needs, widest first (portable: none)
KERNEL_NEEDS: tuple[tuple[str, tuple[str, ...]], ...] = (("avx512", ("avx2", "avx512f", "avx512bw")),
                                                          ("avx2", ("avx2",)), ("portable", ()))


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def cpu_kernels() -> str:
    """The widest kernel set this CPU runs, built or not (``portable`` on any CPU)."""
    have = cpu_flags()
    return next(name for name, needs in KERNEL_NEEDS if all(f in have for f in needs))


# applied at import, so in every process (a benchmark's spawned children too) before anything hashes or copies
PICKED: str | None = memops_choice()


def _chosen(native: ModuleType | None) -> ModuleType | None:
    """``KVPORT_MEMOPS`` (``avx512``, ``avx2``, ``portable`` or ``fallback``) picks the kernels for this
    process and its children (a benchmark of the AVX2 set on an AVX-512 machine, a check of the
    fallbacks); unset, the widest the CPU runs. A name that does not run here is a warning, not an
    error: the default stays."""
    want = PICKED
    if not want or native is None:
        return native
    if want == "fallback":
        return None
    try:
        native.use(want)
    except ValueError:
        warnings.warn(f"KVPORT_MEMOPS={want}: not one of the kernels that run here ({', '.join(native.paths())}, "
                      f"fallback); using {native.path()}", RuntimeWarning, stacklevel=2)
    return native


_native = _chosen(_native)
NATIVE = _native is not None
PATH: str | None = _native.path() if _native is not None else None  # the kernels in use at import


def paths() -> list[str]:
    """The native kernels that run on this CPU, widest first (empty on the fallbacks)."""
    return _native.paths() if _native is not None else []


def path() -> str | None:
    """The native kernels in use now (``None``: the numpy + xxhash fallbacks)."""
    return _native.path() if _native is not None else None


def use(name: str) -> None:
    """Use the native kernels ``name`` (one of :func:`paths`) from now on; ValueError otherwise."""
    if _native is None:
        raise ValueError(f"kvport._memops is not built here: no {name} kernels")
    _native.use(name)

Buffer = bytes | bytearray | memoryview


def xxh3_many(bufs: Sequence[Buffer]) -> bytes:
    """``xxh3_64(bufs[i])`` as u64 LE at ``[8i, 8i+8)``."""
    if _native is None:
        return xxh3_many_py(bufs)
    out = bytearray(8 * len(bufs))
    _native.xxh3_many(bufs, out)
    return bytes(out)


def xxh3_many_py(bufs: Sequence[Buffer]) -> bytes:
    """The fallback of :func:`xxh3_many` (and its reference in the tests)."""
    return np.fromiter((xxhash.xxh3_64_intdigest(b) for b in bufs), dtype="<u8", count=len(bufs)).tobytes()


def spans(bufs: Sequence[Buffer]) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, lengths) of contiguous buffers, as u64 arrays (one native call for all)."""
    out = np.empty(2 * len(bufs), dtype="<u8")
    if _native is not None:
        _native.spans(bufs, out.data)
    else:
        for i, b in enumerate(bufs):
            a = np.frombuffer(b, dtype=np.uint8)
            out[i], out[len(bufs) + i] = a.ctypes.data if a.size else 0, a.size
    return out[: len(bufs)], out[len(bufs) :]


def copy_verify(dsts: Sequence[memoryview], src: Buffer, offsets: np.ndarray, want: Buffer,
                threads: int = 1) -> list[int]:
    """``dsts[i][:] = src[offsets[i] : offsets[i] + len(dsts[i])]`` for every i; returns the indexes
    whose copied bytes' xxh3-64 differs from ``want[8i:8i+8]`` (u64 LE). Every chunk is copied, bad
    ones too (the caller must not link those). ``offsets``: u64 array, one per destination. A chunk
    outside ``src`` is a ValueError before anything is copied."""
    off = np.ascontiguousarray(offsets, dtype="<u8")
    if off.shape != (len(dsts),) or len(want) != 8 * len(dsts):
        raise ValueError(f"{len(dsts)} destinations, {off.size} offsets, {len(want)} digest bytes")
    size = memoryview(src).nbytes
    lens = spans(dsts)[1] if _native is not None else np.fromiter((d.nbytes for d in dsts), np.uint64, len(dsts))
    outside = np.flatnonzero((off > size) | (lens > size - np.minimum(off, size)))
    if outside.size:  # checked for every chunk before any is copied
        i = int(outside[0])
        raise ValueError(f"chunk {i}: [{int(off[i])}, +{int(lens[i])}) is outside the {size}-byte source")
    if _native is not None:
        out: list[int] = _native.copy_verify(dsts, src, off.data, want, threads)
        return out
    return copy_verify_py(dsts, src, off, want)


def copy_verify_py(dsts: Sequence[memoryview], src: Buffer, offsets: np.ndarray, want: Buffer) -> list[int]:
    """The fallback of :func:`copy_verify` (and its reference in the tests): one thread, memcpy."""
    off = np.ascontiguousarray(offsets, dtype="<u8")
    s = memoryview(src).cast("B")
    expect = np.frombuffer(want, dtype="<u8")
    bad: list[int] = []
    for i, (d, o) in enumerate(zip(dsts, off.tolist(), strict=True)):
        n = d.nbytes
        if o + n > s.nbytes:
            raise ValueError(f"chunk {i}: [{o}, +{n}) is outside the {s.nbytes}-byte source")
        d[:] = s[o : o + n]  # (copy_verify checked every chunk's bounds before the first copy)
        if xxhash.xxh3_64_intdigest(d) != int(expect[i]):
            bad.append(i)
    return bad
