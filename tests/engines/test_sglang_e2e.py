"""kvport's HiCache backend inside SGLang's own server processes, with the reference model on this CPU:
one SGLang engine stores a prompt's pages in the shared tier (a real ``kvport serve``), a second SGLang
engine, started afterwards, loads them from there and answers exactly as SGLang without any backend."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from kvport.client.conn import ClientConfig
from kvport.client.remote import RemoteTier
from kvport.deploy.sglang_serve import SGLangServer, storage_tokens
from kvport.deploy.vllm_serve import KVPortServer, free_ports
from tests.waits import until

SHIMS = Path(__file__).resolve().parents[1] / "support" / "sglang_cpu"
PAGE = 64


def _env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(SHIMS), os.environ.get("PYTHONPATH", "")) if p)}


def _held(port: int) -> int:
    """Whole pages (values of at least a page of the reference model) the kvport server holds."""
    client = RemoteTier(ClientConfig(port=port))
    try:
        return int(client.used_bytes) // (PAGE * 46_080)
    finally:
        client.close()


def _server(model_dir: Path, port: int, tmp: Path, name: str, storage: str | None, **kw: object) -> SGLangServer:
    return SGLangServer(model_dir, port, storage=storage, log=tmp / f"{name}.log", max_total_tokens=4096,
                        threads=1, env=_env(), **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(900)
def test_second_engine_loads_what_the_first_stored(model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(30)
    prompt = [rng.randrange(200, 40000) for _ in range(10 * PAGE + 17)]
    shared = KVPortServer(tmp_path / "kvport-serve.log", ("--capacity", "1GiB", "--max-value", "8MiB")).start()
    p_plain, p_a, p_b = free_ports(3)
    plain = _server(model_dir, p_plain, tmp_path, "plain", None)
    extra = {"kvport_server": f"127.0.0.1:{shared.port}", "kvport_server_write": "through"}
    a = _server(model_dir, p_a, tmp_path, "a", "kvport", extra=extra)
    # layer_first for both: SGLang's page-first host transfers need a device stream (not on a CPU); pages
    # crossing host layouts are tested at the interface (test_sglang_storage.py)
    b = _server(model_dir, p_b, tmp_path, "b", "kvport", extra=extra)
    try:
        plain.start()
        a.start()
        plain.wait_healthy()
        a.wait_healthy()
        want = plain.generate(prompt, max_new_tokens=12)["output_ids"]
        plain.stop()
        first = a.generate(prompt, max_new_tokens=12)
        assert first["output_ids"] == want and storage_tokens(first) == 0
        # HiCache writes the pages to storage behind the request (its backup thread): wait for all 10
        pages = len(prompt) // PAGE
        until(lambda: _held(shared.port) >= pages, "the shared tier never got the first engine's pages", 60, 0.2)
        a.stop()  # a's process is gone: only the shared tier has its pages
        b.start()
        b.wait_healthy()
        second = b.generate(prompt, max_new_tokens=12)
        # every whole page of the prompt but the one holding its last token came from kvport
        assert storage_tokens(second) == (len(prompt) - 1) // PAGE * PAGE
        assert second["output_ids"] == want
    finally:
        for s in (plain, a, b):
            s.stop()
        shared.stop()
