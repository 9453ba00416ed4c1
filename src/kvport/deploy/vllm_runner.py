"""One vLLM engine in a child process, driven by a JSON job: the unit of :mod:`.vllm_measure`.

``python -m kvport.deploy.vllm_runner JOB.json OUT.json``: start ``LLM`` (float32, eager,
multiprocessing off, the KVPortConnector when ``disk_dir`` is set), run the warm-up prompts,
then each target prompt alone, and write one JSON result. A fresh process per job is the point:
nothing is shared with another engine except the DiskTier folder.

Result per target prompt: ``ttft_s`` (vLLM's own first-token latency of that request, measured
from its arrival in the engine core), ``wall_s`` (the whole ``generate`` call), the generated
token ids and their logprobs, ``num_cached_tokens`` (vLLM's count: local + external) and
``external_hits`` (the increase of vLLM's ``vllm:external_prefix_cache_hits`` counter).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvport.evidence.pagecache import drop_file_cache

CONNECTOR = "KVPortConnector"
CONNECTOR_MODULE = "kvport.engines.vllm.connector"

# Fast start-up on CPU (measured in ../shared/notes/vllm-cpu.md): scheduler and worker in one
# process, a small KV pool, no hub, eager mode.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_USE_AOT_COMPILE": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@dataclass(frozen=True, slots=True)
class EngineJob:
    model_dir: str
    targets: list[list[int]]
    warmup: list[list[int]] = field(default_factory=list)
    disk_dir: str | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 4
    max_model_len: int = 4096
    block_size: int = 32
    drop_cache_before_targets: bool = False
    tensor_parallel_size: int = 1  # > 1: vLLM's worker processes, one per rank (threads unbound on a CPU)
    enable_prefix_caching: bool = True  # off: a prompt seen before is loaded from kvport, not vLLM's cache


@dataclass(frozen=True, slots=True)
class TargetResult:
    ttft_s: float | None
    wall_s: float
    token_ids: list[int]
    logprobs: list[float]
    num_cached_tokens: int | None
    external_hits: float | None
    connector: dict[str, Any] | None  # the worker connector's counters for this request alone


def kv_transfer_config(disk_dir: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``kv_transfer_config`` that plugs KVPortConnector into ``LLM(...)`` (its store: the disk
    folder, and whatever ``extra`` names: ``kvport_redis``, ``kvport_server``)."""
    disk = {} if disk_dir is None else {"kvport_disk_dir": disk_dir}
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**disk, **(extra or {})},
    }


def _external_hits(llm: Any) -> float | None:
    for m in llm.get_metrics():
        if m.name == "vllm:external_prefix_cache_hits":
            return float(m.value)
    return None


def _drop_cache(folder: Path) -> None:
    """posix_fadvise(DONTNEED) every file of the tier folder: the next load reads the disk."""
    for p in folder.rglob("*"):
        if p.is_file():
            drop_file_cache(p)


def run(job: EngineJob) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt

    kw: dict[str, Any] = {"enable_prefix_caching": job.enable_prefix_caching}
    if job.tensor_parallel_size > 1:
        kw |= {"tensor_parallel_size": job.tensor_parallel_size, "distributed_executor_backend": "mp"}
    if job.disk_dir is not None or {"kvport_redis", "kvport_server"} & set(job.extra_config):
        kw["kv_transfer_config"] = kv_transfer_config(job.disk_dir, job.extra_config)
    t0 = time.perf_counter()
    llm = LLM(model=job.model_dir, dtype="float32", enforce_eager=True, max_model_len=job.max_model_len,
              disable_log_stats=False, seed=0, block_size=job.block_size, **kw)
    startup_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, logprobs=0)
    for w in job.warmup:
        llm.generate([TokensPrompt(prompt_token_ids=w)], sp, use_tqdm=False)
    if job.drop_cache_before_targets and job.disk_dir is not None:
        _drop_cache(Path(job.disk_dir))
    results: list[TargetResult] = []
    for target in job.targets:
        hits0 = _external_hits(llm)
        stats0 = _connector_stats()
        t1 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=target)], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t1
        hits1 = _external_hits(llm)
        stats1 = _connector_stats()
        delta = None if stats0 is None or stats1 is None else {k: stats1[k] - stats0[k] for k in stats1}
        comp = out.outputs[0]
        lps = [float(step[tok].logprob) for tok, step in zip(comp.token_ids, comp.logprobs or [], strict=True)]
        ttft = getattr(out.metrics, "first_token_latency", None) if out.metrics is not None else None
        results.append(TargetResult(
            ttft_s=float(ttft) if ttft else None, wall_s=wall, token_ids=list(comp.token_ids), logprobs=lps,
            num_cached_tokens=out.num_cached_tokens,
            external_hits=None if hits0 is None or hits1 is None else hits1 - hits0, connector=delta))
    return {"startup_s": startup_s, "targets": [asdict(r) for r in results], "connector": _connector_stats()}


def _connector_stats() -> dict[str, Any] | None:
    """The worker-side connector's counters (reachable because multiprocessing is off)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    if not has_kv_transfer_group():
        return None
    stats = getattr(get_kv_transfer_group(), "worker_stats", None)
    return None if stats is None else asdict(stats)


def main(argv: list[str]) -> int:
    job_path, out_path = Path(argv[0]), Path(argv[1])
    job = EngineJob(**json.loads(job_path.read_text()))
    result = run(job)
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk. vLLM's interpreter teardown (engine threads, atexit hooks) took 13-20 s
    # on a busy 2-core machine; a job process has nothing left to clean up, so skip it.
    os._exit(code)
