"""``kvport bench device``: the CUDA device tier against pinned ``cudaMemcpy`` of the same bytes.

The limit is ``cudaMemcpyAsync`` between a pinned host tensor and a device tensor (torch's
``copy_(non_blocking=True)`` on a side stream, timed to its completion), host->device and
device->host, measured in the same run as the results. The results are :class:`~kvport.tiers.DeviceTier`
``put_many`` / ``get_many_into`` of the same bytes as KV blocks (4 MiB: one block of
llama-3.1-8B bf16 at 16 tokens), from pinned host memory (what a pinned host tier or the vLLM
connector's pinned staging hands it) and from pageable memory (through the tier's double-buffered
pinned staging). Every value read back is compared with what was put.

Without CUDA every figure is ``null`` and ``conditions.no_device`` says why: nothing is guessed.
Transformers prefix reuse on the GPU is not part of this suite yet (``results.prefix_reuse_gpu``:
``null``, with the reason); ``kvport bench prefix`` measures it on the CPU.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from kvport.bench.harness import Report, SuiteOptions, conditions, finish
from kvport.evidence.timing import gbps, ratio, time_it

_VALUE = 4 << 20

_FIELDS = ("put_pinned_gbps", "put_pinned_vs_pinned_memcpy", "get_pinned_gbps", "get_pinned_vs_pinned_memcpy",
           "put_pageable_gbps", "put_pageable_vs_pinned_memcpy", "get_pageable_gbps",
           "get_pageable_vs_pinned_memcpy", "values_checked", "mismatches")


def _no_device(why: str, cond: dict[str, Any]) -> Report:
    cond["no_device"] = why
    results: dict[str, Any] = dict.fromkeys(_FIELDS)
    results["prefix_reuse_gpu"] = None
    return finish(Report("device", cond, {"pinned_h2d_gbps": None, "pinned_d2h_gbps": None}, results))


def run(opts: SuiteOptions) -> Report:
    total = (256 << 20) if opts.quick else (1 << 30)
    trials = 2 if opts.quick else 5
    cond = conditions(value_bytes=_VALUE, total_bytes=total, trials=trials,
                      limit="cudaMemcpyAsync pinned <-> device of the same bytes, on a side stream")
    try:
        import torch
    except ImportError:
        return _no_device("torch is not installed", cond)
    if not torch.cuda.is_available():
        return _no_device(f"torch {torch.__version__} sees no CUDA device", cond)
    from kvport.tiers import DeviceTier

    cond["device"] = torch.cuda.get_device_name()
    cond["torch"], cond["cuda"] = torch.__version__, torch.version.cuda
    n = total // _VALUE
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
    pageable = pinned.numpy().copy()  # the same bytes, pageable
    back_pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    back_pageable = np.empty(total, dtype=np.uint8)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def copy(dst: Any, src: Any) -> None:
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        side.synchronize()  # type: ignore[no-untyped-call]

    h2d = time_it(lambda: copy(dev, pinned), trials)
    d2h = time_it(lambda: copy(back_pinned, dev), trials)
    limits = {"pinned_h2d_gbps": round(gbps(total, h2d.median_s), 3),
              "pinned_d2h_gbps": round(gbps(total, d2h.median_s), 3)}
    dev = dev.new_empty(0)  # the limit's device buffer freed before the tier's pool takes its place
    tier = DeviceTier(total, _VALUE)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    mv_pin, mv_page = pinned.numpy().data, pageable.data
    mv_back_pin, mv_back_page = back_pinned.numpy().data, back_pageable.data

    def span(mv: memoryview, i: int) -> memoryview:
        return mv[i * _VALUE : (i + 1) * _VALUE]

    def put(mv: memoryview) -> None:
        for k in keys:
            tier.delete(k)
        tier.put_many([(k, span(mv, i)) for i, k in enumerate(keys)])

    def get(mv: memoryview) -> None:
        tier.get_many_into([(k, span(mv, i)) for i, k in enumerate(keys)])

    results: dict[str, Any] = {}
    for label, src, dst in (("pinned", mv_pin, mv_back_pin), ("pageable", mv_page, mv_back_page)):
        tp = time_it(partial(put, src), trials)
        tg = time_it(partial(get, dst), trials)
        results[f"put_{label}_gbps"] = round(gbps(total, tp.median_s), 3)
        results[f"put_{label}_vs_pinned_memcpy"] = ratio(gbps(total, tp.median_s), limits["pinned_h2d_gbps"])
        results[f"get_{label}_gbps"] = round(gbps(total, tg.median_s), 3)
        results[f"get_{label}_vs_pinned_memcpy"] = ratio(gbps(total, tg.median_s), limits["pinned_d2h_gbps"])
    want = pinned.numpy().reshape(n, _VALUE)
    bad = [int(np.count_nonzero((got.reshape(n, _VALUE) != want).any(axis=1)))
           for got in (back_pinned.numpy(), back_pageable)]
    results["values_checked"] = 2 * n
    results["mismatches"] = sum(bad)  # values read back that differ from what was put
    results["prefix_reuse_gpu"] = None
    cond["prefix_reuse_gpu"] = "not measured by this suite yet (kvport bench prefix runs on the CPU)"
    tier.close()
    return finish(Report("device", cond, limits, results))
