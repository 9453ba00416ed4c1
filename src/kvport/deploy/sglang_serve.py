"""One SGLang server process (``python -m sglang.launch_server``) with HiCache and an L3 storage backend:
kvport's (``storage="kvport"``), SGLang's own file backend (``"file"``), or none.

::

    SGLangServer(model_dir, port, storage="kvport", extra={"kvport_server": "127.0.0.1:7878"}, log=path)
        .start() / .wait_healthy() / .generate(ids, max_new_tokens) / .flush() / .stop()

On a CPU (``device="cpu"``) SGLang runs its CPU engine (``SGLANG_USE_CPU_ENGINE=1``) with the HiCache
settings measured to work there: ``--hicache-io-backend direct --hicache-mem-layout layer_first``.
What SGLang 0.5.23 additionally needs on a machine without its CPU kernels (stand-ins for two
``sgl_kernel`` functions and torchvision, unpinned host memory) is not kvport's: the caller's
environment brings it (``PYTHONPATH=tests/support/sglang_cpu``, docs/sglang.md).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvport.config import Settings, subprocess_env
from kvport.errors import EngineError

from .vllm_serve import EngineServer

BACKEND_MODULE = "kvport.engines.sglang.storage"
BACKEND_CLASS = "KVPortStorage"
STORAGE = ("kvport", "file", None)


def storage_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` loading kvport's backend with the zero-copy calls."""
    return {"backend_name": "kvport", "module_path": BACKEND_MODULE, "class_name": BACKEND_CLASS,
            "interface_v1": 1, **extra}


class SGLangServer(EngineServer):
    """An SGLang server in its own process group (start, health, stop as :class:`EngineServer`'s)."""

    def __init__(self, model_dir: Path, port: int, *, storage: str | None, log: Path,
                 extra: Mapping[str, Any] | None = None, file_dir: Path | None = None, page_size: int = 64,
                 layout: str = "layer_first", max_total_tokens: int = 16384, hicache_size_gb: int = 1,
                 device: str = "cpu", threads: int | None = None, env: Mapping[str, str] | None = None,
                 host: str = "127.0.0.1", args: Sequence[str] = ()) -> None:
        if storage not in STORAGE:
            raise EngineError(f"storage must be one of {STORAGE}, got {storage!r}")
        if storage == "file" and file_dir is None:
            raise EngineError("SGLang's file backend needs file_dir")
        self.model_dir, self.port, self.log, self.host, self.netns = model_dir, port, log, host, None
        self.role = storage
        self.url = f"http://{host}:{port}"
        self.argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                     "--host", host, "--port", str(port), "--dtype", "float32", "--device", device,
                     "--page-size", str(page_size), "--max-total-tokens", str(max_total_tokens),
                     "--random-seed", "0", "--log-level", "warning", "--skip-server-warmup"]
        if storage is not None:
            self.argv += ["--enable-hierarchical-cache", "--hicache-size", str(hicache_size_gb),
                          "--hicache-mem-layout", layout, "--hicache-storage-backend",
                          "dynamic" if storage == "kvport" else "file"]
            if device == "cpu":
                self.argv += ["--hicache-io-backend", "direct"]
            if storage == "kvport":
                self.argv += ["--hicache-storage-backend-extra-config", json.dumps(storage_config(extra or {}))]
        self.argv += list(args)
        cache = Settings.from_env().home / "sglang"
        own = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               # SGLang builds its page-hash extension once; kept beside kvport's other caches
               "TORCH_EXTENSIONS_DIR": str(cache / "torch_extensions"), "SGLANG_CACHE_DIR": str(cache)}
        if device == "cpu":
            own["SGLANG_USE_CPU_ENGINE"] = "1"
        if threads is not None:
            own["OMP_NUM_THREADS"] = str(threads)
        if storage == "file":
            own["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(file_dir)
        self.own_env = {**own, **(env or {})}
        self.env = subprocess_env(self.own_env)
        self.metrics_dir = log.parent / f"prometheus-{port}"
        self.proc = None

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Until a generation answers (SGLang's /health answers before the scheduler has its model)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EngineError(f"SGLang on port {self.port} exited: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise EngineError(f"SGLang on port {self.port} not ready after {timeout_s:.0f} s: {self.tail()}")

    def _post(self, path: str, body: Mapping[str, Any] | None, timeout_s: float) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return bytes(r.read())
        except (urllib.error.URLError, OSError) as exc:
            raise EngineError(f"SGLang {path} on port {self.port}: {exc}") from exc

    def generate(self, ids: Sequence[int], max_new_tokens: int = 1, timeout_s: float = 600.0) -> dict[str, Any]:
        """Greedy generation from token ids; the answer with ``seconds`` (wall time of the call) added."""
        t0 = time.perf_counter()
        raw = self._post("/generate", {"input_ids": [int(i) for i in ids],
                                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}},
                         timeout_s)
        out: dict[str, Any] = json.loads(raw)
        out["seconds"] = time.perf_counter() - t0
        return out

    def flush(self) -> None:
        """Drop the device and host caches (``/flush_cache``; L3 keeps its pages)."""
        self._post("/flush_cache", None, 60.0)


def storage_tokens(answer: Mapping[str, Any]) -> int:
    """Prompt tokens SGLang took from its L3 storage for this answer."""
    details = answer.get("meta_info", {}).get("cached_tokens_details") or {}
    return int(details.get("storage", 0) or 0)
