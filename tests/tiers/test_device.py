"""The CUDA device tier: without CUDA it refuses to start and ``kvport bench device`` reports every
figure as unknown with the reason; with CUDA (the GPU check, ``.ci/gpu-check``) its copies from and
to pinned and pageable memory, single and batched, values larger than its staging, are exact."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvport.errors import BufferMismatchError, TierError, TierFullError
from kvport.tiers import DeviceTier

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_device_tier_needs_cuda() -> None:
    with pytest.raises(TierError):
        DeviceTier(1 << 20, 1 << 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_bench_device_without_cuda_says_unknown_and_why() -> None:
    out = subprocess.run([sys.executable, "-m", "kvport.cli.main", "bench", "device", "--quick"],
                         capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout)
    assert report["suite"] == "device" and "no CUDA device" in report["conditions"]["no_device"]
    assert report["limits"] == {"pinned_h2d_gbps": None, "pinned_d2h_gbps": None}
    assert report["results"] and all(v is None for v in report["results"].values())


@needs_cuda
def test_device_tier_round_trip() -> None:
    t = DeviceTier(4 << 10, 1 << 10)
    t.put(b"k" * 16, bytes(range(256)) * 3)
    out = bytearray(1024)
    assert t.get_into(b"k" * 16, out) == 768
    assert bytes(out[:768]) == bytes(range(256)) * 3
    assert t.used_bytes == 1024 and t.delete(b"k" * 16) and t.used_bytes == 0


@needs_cuda
@pytest.mark.parametrize("pinned", [False, True])
def test_device_tier_batches_exact_through_staging_and_pinned(pinned: bool) -> None:
    page, n = 3 << 20, 5  # values larger than a staging half (1 MiB with staging_bytes=2 MiB)
    t = DeviceTier(page * n, page, staging_bytes=2 << 20)
    rng = np.random.default_rng(1)
    src = torch.from_numpy(rng.integers(0, 256, page * n, dtype=np.uint8))
    if pinned:
        src = src.pin_memory()
    mv = memoryview(src.numpy())
    sizes = [page, page - 7, 1, page // 2 + 3, page]
    items = [(bytes([i]) * 16, mv[i * page : i * page + sizes[i]]) for i in range(n)]
    t.put_many(items)
    back = torch.zeros(page * n, dtype=torch.uint8)
    if pinned:
        back = back.pin_memory()
    bmv = memoryview(back.numpy())
    got = t.get_many_into([(k, bmv[i * page : (i + 1) * page]) for i, (k, _) in enumerate(items)] +
                          [(b"missing" * 2 + b"xx", bytearray(page))])
    assert got == [*sizes, None]
    for i, (_, v) in enumerate(items):
        assert bytes(bmv[i * page : i * page + sizes[i]]) == bytes(v)
    with pytest.raises(TierFullError):
        t.put(b"z" * 16, b"x")
    with pytest.raises(BufferMismatchError):
        t.put(items[0][0], bytes(page + 1))
    assert t.used_bytes == page * n  # a refused put changed nothing
