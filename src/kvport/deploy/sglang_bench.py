"""The SGLang half of ``kvport bench prefix`` (``--set engine=sglang``): time to first token of a prompt
whose first ``cached`` tokens sit in HiCache's L3 storage, kvport's backend against SGLang's own file
backend and against recompute, in fresh SGLang server processes, one backend at a time (2 cores).

Per trial, on each server, a fresh random prompt P of ``tokens`` ids:

1. ``P[: cached + 1]`` is generated once: HiCache writes its ``cached // page`` whole pages through
   host memory to the L3 backend; after a short wait for that write, ``/flush_cache`` empties the
   device and host caches (L3 keeps its pages);
2. ``hit``: P itself, one new token: ``cached`` tokens come from L3, the rest are prefilled (its
   ``cached_tokens_details.storage`` is checked and reported);
3. ``device_hit``: P again, at once: SGLang's own radix cache holds it (the engine's floor: what any
   hit costs without loading anything);
4. ``recompute``: ``/flush_cache``, then a fresh prompt of the same length, nothing cached anywhere.

``ttft_speedup`` = median recompute / median kvport hit; ``ttft_vs_file_backend`` = median kvport
hit / median file-backend hit; ``tokens_equal``: 16 greedy tokens of one prompt recomputed, loaded from
kvport and loaded from the file backend are the same. The L3 bytes are compared with a raw disk read of
the same size measured in the same run, and each backend's own load of those pages is timed in this
process through SGLang's calls and its real host pool (``backend_only``), beside memcpy: in the
servers, the rest of a hit's TTFT is SGLang's (its prefetch machinery, the suffix's prefill).
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvport.config import Settings
from kvport.errors import EngineError
from kvport.evidence.limits import raw_disk_gbps
from kvport.spec import KVSpec, from_hf_config

from .sglang_serve import SGLangServer, storage_tokens
from .vllm_serve import free_port

PAGE = 64
WRITE_WAIT_S = 1.5  # HiCache's host -> L3 write runs behind the request (its backup thread)
VOCAB = (200, 40000)


def _median(ts: list[float]) -> float:
    return statistics.median(ts)


def _stats(ts: list[float]) -> dict[str, float]:
    return {"median_s": round(_median(ts), 4), "min_s": round(min(ts), 4), "max_s": round(max(ts), 4),
            "trials": len(ts)}


def _ttft(answer: Mapping[str, Any]) -> float:
    """SGLang's own end-to-end latency of a one-token request (its wall time when absent)."""
    meta = answer.get("meta_info", {})
    return float(meta.get("e2e_latency") or answer["seconds"])


def _one_backend(server: SGLangServer, rng: random.Random, tokens: int, cached: int, trials: int,
                 check: list[int]) -> dict[str, Any]:
    fresh: Callable[[], list[int]] = lambda: [rng.randrange(*VOCAB) for _ in range(tokens)]  # noqa: E731
    server.start()
    try:
        server.wait_healthy(600)
        server.generate(fresh()[:256])  # warm-up (first-request compilation, allocations)
        ts: dict[str, list[float]] = {"hit": [], "device_hit": [], "recompute": []}
        stored: list[int] = []
        short = 0
        for _ in range(trials):
            for attempt in range(3):  # a hit that found fewer pages (their write still behind) is redone
                prompt = fresh()
                server.generate(prompt[: cached + 1])
                time.sleep(WRITE_WAIT_S * (attempt + 1))
                server.flush()
                hit = server.generate(prompt)
                if storage_tokens(hit) == cached:
                    break
                short += 1
            ts["hit"].append(_ttft(hit))
            stored.append(storage_tokens(hit))
            ts["device_hit"].append(_ttft(server.generate(prompt)))
            server.flush()
            ts["recompute"].append(_ttft(server.generate(fresh())))
        cold = server.generate(check, max_new_tokens=16)["output_ids"]
        time.sleep(WRITE_WAIT_S)
        server.flush()
        loaded = server.generate(check, max_new_tokens=16)
        return {"ttft": {k: _stats(v) for k, v in ts.items()}, "storage_tokens": stored, "short_hits_redone": short,
                "check_storage_tokens": storage_tokens(loaded), "check_recomputed": cold,
                "check_loaded": loaded["output_ids"], "_medians": {k: _median(v) for k, v in ts.items()}}
    finally:
        server.stop()


def mha_host_pool(spec: KVSpec, layout: str, tokens: int) -> Any:
    """SGLang's own MHA host pool (its real class) for ``spec``'s rank on the CPU, ``2 x tokens`` big,
    filled with random KV (unpinned: no accelerator)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dtype = getattr(torch, spec.dtype.torch_name)
    heads, dim, layers = spec.kv_heads_per_rank, spec.head_dim, spec.num_layers
    k = [torch.zeros(tokens, heads, dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(tokens, heads, dim, dtype=dtype) for _ in range(layers)]

    def ptrs(ts: list[Any]) -> Any:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=spec.block_size, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=dtype,
                         device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, spec.block_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(dtype))
    pool.device_tensors = (k, v)  # what its pointer tables name, alive as long as the pool
    return pool


def backend_loads(model: Path, root: Path, cached: int, trials: int) -> dict[str, Any]:
    """The two backends' own load of ``cached`` tokens, in this process, through SGLang's calls and its
    real host pool: kvport's ``batch_get_v1`` (disk tier: read, envelope check, copy into the pool) and
    the file backend's ``batch_get`` + ``set_from_flat_data_page`` as SGLang's generic path makes them
    (a fresh flat page per page, read into, copied into the pool; nothing checked). Both read what the
    page cache holds, as in the servers. With memcpy of the same bytes, measured here."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvport.evidence.limits import memcpy_gbps

    from .sglang_serve import storage_config

    spec = from_hf_config(model, dtype="fp32", block_size=PAGE)
    pages = cached // PAGE
    pool = mha_host_pool(spec, "layer_first", 2 * cached + PAGE)
    names = [f"{i:064x}" for i in range(pages)]

    def cfg(extra: dict[str, Any]) -> Any:
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                    is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                    model_name=str(model), extra_config=extra)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kv = StorageBackendFactory.create_backend("dynamic", cfg(storage_config(
            {"kvport_disk_dir": str(root / "inproc-kvport")})), pool)
        kv.register_mem_pool_host(pool)
        src = torch.arange(0, pages * PAGE)
        dst = torch.arange(pages * PAGE, 2 * pages * PAGE)
        if not all(kv.batch_set_v1(names, src)):
            raise EngineError("kvport's backend did not store the pages")
        fb = HiCacheFile(cfg({"file_storage_path": str(root / "inproc-file")}))
        fb.register_mem_pool_host(pool)
        fb.batch_set(names, [pool.get_data_page(i * PAGE) for i in range(pages)])
        ts: dict[str, list[float]] = {"kvport": [], "file": []}
        for _ in range(trials):
            t0 = time.perf_counter()
            ok = kv.batch_get_v1(names, dst)
            ts["kvport"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            # as SGLang's generic path calls a backend without the zero-copy calls (cache_controller's
            # _generic_page_get): a fresh flat page per page, read into, then copied into the pool
            flat = [pool.get_dummy_flat_data_page() for _ in names]
            got = fb.batch_get(names, flat)
            for i, page in enumerate(got):
                pool.set_from_flat_data_page(int(dst[i * PAGE]), page)
            ts["file"].append(time.perf_counter() - t0)
            if not all(ok) or any(g is None for g in got):
                raise EngineError("a backend missed a page it holds")
        kv.close()
    finally:
        torch.set_num_threads(before)
    nbytes = cached * spec.bytes_per_token
    med = {k: _median(v) for k, v in ts.items()}
    return {"load_s": {k: round(v, 4) for k, v in med.items()},
            "load_gbps": {k: round(nbytes / v / 1e9, 3) for k, v in med.items()},
            "kvport_vs_file": round(med["kvport"] / med["file"], 3),
            "memcpy_gbps": round(memcpy_gbps(nbytes), 3), "threads": 1}


def prefix_ttft(tokens: int = 2048, cached: int = 1920, trials: int = 5, threads: int | None = 1,
                env: Mapping[str, str] | None = None, attention: str = "native") -> dict[str, Any]:
    """kvport's backend vs SGLang's file backend vs recompute (see the module). EngineError when SGLang
    is not installed or a server fails (the suite then reports None, never a guess).

    ``attention="suffix"`` asks the servers' environment for the extend that computes only the new
    tokens' attention (``KVPORT_SGLANG_SUFFIX_ATTENTION=1``, honoured by tests/support/sglang_cpu):
    SGLang's CPU fallback recomputes the prefix's attention at every extend, which hides any hit."""
    if attention not in ("native", "suffix"):
        raise EngineError(f"attention must be native or suffix, got {attention!r}")
    env = {**(env or {}), **({"KVPORT_SGLANG_SUFFIX_ATTENTION": "1"} if attention == "suffix" else {})}
    if importlib.util.find_spec("sglang") is None:
        raise EngineError("SGLang is not installed (pip install 'kvport[sglang]'; docs/sglang.md)")
    cached = cached // PAGE * PAGE
    if not 0 < cached < tokens:
        raise EngineError(f"need 0 < cached < tokens in whole {PAGE}-token pages, got {cached}/{tokens}")
    model = Settings.from_env().model_dir
    rng = random.Random(2048)
    check = [rng.randrange(*VOCAB) for _ in range(tokens)]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvport-sglang-bench-") as tmp:
        root = Path(tmp)
        common: dict[str, Any] = {"max_total_tokens": max(16384, 4 * tokens), "threads": threads,
                                  "env": dict(env or {}), "page_size": PAGE}
        runs = {
            "kvport": SGLangServer(model, free_port(), storage="kvport", log=root / "kvport.log",
                                   extra={"kvport_disk_dir": str(root / "kvport-tier")}, **common),
            "file": SGLangServer(model, free_port(), storage="file", log=root / "file.log",
                                 file_dir=root / "file-tier", **common),
        }
        for name, server in runs.items():
            try:
                out[name] = _one_backend(server, random.Random(7), tokens, cached, trials, check)
            except EngineError as exc:
                raise EngineError(f"SGLang with the {name} backend: {exc}") from exc
        stored_bytes = cached * from_hf_config(model, dtype="fp32").bytes_per_token
        disk = raw_disk_gbps(root, stored_bytes)
        in_process = backend_loads(model, root, cached, trials)
    k, f = out["kvport"]["_medians"], out["file"]["_medians"]
    loaded_both = out["kvport"]["check_storage_tokens"] > 0 and out["file"]["check_storage_tokens"] > 0
    results: dict[str, Any] = {
        "ttft_speedup": round(k["recompute"] / k["hit"], 3),
        "ttft_vs_file_backend": round(k["hit"] / f["hit"], 3),
        # the same 16 tokens recomputed and loaded from each backend (a check that loaded nothing fails)
        "tokens_equal": loaded_both and out["kvport"]["check_loaded"] == out["kvport"]["check_recomputed"]
        == out["file"]["check_loaded"] == out["file"]["check_recomputed"],
        "all_hits_full": all(n == cached for r in out.values() for n in r["storage_tokens"]),
        "ttft_speedup_file_backend": round(f["recompute"] / f["hit"], 3),
        "ttft_speedup_device_hit": round(k["recompute"] / k["device_hit"], 3),
        "hit_over_device_hit": round(k["hit"] / k["device_hit"], 3),
        # hit minus device hit: the L3 load, SGLang's prefetch machinery and the suffix's prefill beyond
        # the device hit's one token (an upper bound on the load; the backends' own: backend_only)
        "hit_minus_device_hit_s": {"kvport": round(k["hit"] - k["device_hit"], 4),
                                   "file": round(f["hit"] - f["device_hit"], 4)},
        "raw_disk_read_gbps": round(disk["read_gbps"], 3),
        "backend_only": in_process,
        "bytes_in_tier": stored_bytes,
        "tokens": tokens, "cached_tokens": cached, "page_size": PAGE, "threads": threads, "attention": attention,
    }
    for name in ("kvport", "file"):
        run = out[name]
        run.pop("_medians")
        results[name] = run
    return results

