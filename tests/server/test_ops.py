"""Operations against a real server: /metrics, /healthz, ``kvport inspect``, graceful drain."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvport.cli.main import main
from kvport.errors import TierUnavailableError

from .conftest import MiB, base_args


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_and_healthz(shared_server) -> None:  # type: ignore[no-untyped-def]
    c = shared_server.client()
    c.put(b"m" * 16, np.ones(2 * MiB, dtype=np.uint8))
    c.get_into(b"m" * 16, bytearray(2 * MiB))
    c.ping()  # the same connection: the GET's handler finished (it counts after its last byte is sent)
    c.close()
    port = shared_server.info["http_port"]
    assert http_get(port, "/healthz") == (200, "ok\n")
    status, text = http_get(port, "/metrics")
    assert status == 200
    assert 'kvport_server_requests_total{op="put",result="stored"}' in text
    assert 'kvport_server_requests_total{op="get",result="hit"}' in text
    assert 'kvport_server_used_bytes{place="host"}' in text
    assert http_get(port, "/nope")[0] == 404


def test_inspect_shows_usage_tenants_prefixes_pins_leases(shared_server, capsys) -> None:  # type: ignore[no-untyped-def]
    c = shared_server.client()
    keys = [bytes([40 + i]) * 16 for i in range(3)]
    for k in keys:
        c.put(k, np.ones(MiB, dtype=np.uint8))
    for _ in range(3):
        c.get_into(keys[2], bytearray(MiB))
    c.pin(keys[:1])
    lease = c.lookup(keys, lease_s=30)
    assert main(["inspect", "--server", f"127.0.0.1:{shared_server.port}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    host = next(t for t in doc["server"]["tiers"] if t["name"] == "host")
    assert host["blocks"] >= 3 and host["used"] >= 3 * MiB
    assert [t["name"] for t in doc["tenants"]] == ["default"]
    assert doc["top_prefixes"][0] == {"tenant": "default", "key": keys[2].hex(), "hits": 3, "bytes": MiB,
                                      "tier": "host"}
    (pin,) = [p for p in doc["pins"] if p["key"] == keys[0].hex()]
    assert pin["holder"].startswith("client:default/") and pin["count"] == 1 and pin["expires_in_s"] > 0
    assert any(ls["lease"] == lease.lease_id and ls["blocks"] == 3 for ls in doc["leases"])
    assert main(["inspect", "--server", f"127.0.0.1:{shared_server.port}"]) == 0
    text = capsys.readouterr().out
    assert "top prefixes" in text and keys[2].hex() in text
    c.unpin(keys[:1])
    c.release(lease.lease_id)
    c.close()


@pytest.mark.parametrize("bad", ["nohost", "127.0.0.1:99999"])
def test_serve_rejects_bad_listen(bad: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["serve", "--listen", bad]) == 2
    assert "--listen" in capsys.readouterr().err


def test_tls_end_to_end(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=kvport", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    srv = server_factory(*base_args("384MiB", "--tls-cert", str(cert), "--tls-key", str(key)))
    c = srv.client(tls=True, tls_ca=cert)
    value = np.arange(3 * MiB + 5, dtype=np.uint8)
    c.put(b"t" * 16, value)
    out = bytearray(4 * MiB)
    assert c.get_into(b"t" * 16, out) == value.nbytes and out[: value.nbytes] == value.tobytes()
    c.close()
    with pytest.raises(TierUnavailableError):  # a plaintext client cannot talk to a TLS server
        srv.client(retries=0, timeout_s=3)


def test_a_start_that_fails_half_way_leaves_nothing_open(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The HTTP port is taken: start() raises ConfigError after the store, the disk folder's lock and the
    listener were opened, and closes them again (the same folder then serves another server)."""
    import asyncio
    import dataclasses
    import socket

    import psutil

    from kvport.errors import ConfigError
    from kvport.server.app import KVServer, ServerConfig
    from kvport.server.limits import ServerLimits

    async def scenario() -> None:
        blocker = socket.create_server(("127.0.0.1", 0))
        busy = int(blocker.getsockname()[1])
        limits = ServerLimits(max_value_bytes=4 * MiB, total_inflight_bytes=8 * MiB)
        rss = psutil.Process().memory_info().rss  # the host pool is what the capacity leaves above this
        # ... and above the lease records' budget (at most 112 MiB for one tenant: kvport.server.app)
        cfg = ServerConfig(capacity_bytes=rss + 80 * MiB + 112 * MiB, disk_dir=tmp_path / "disk", http_port=busy,
                           limits=limits, io_threads=2)
        failed = KVServer(cfg)
        try:
            with pytest.raises(ConfigError, match=f"--http-port {busy}"):
                await failed.start()
        finally:
            blocker.close()
        assert failed.port != 0
        with pytest.raises(ConnectionRefusedError):  # its listener is closed
            socket.create_connection(("127.0.0.1", failed.port), timeout=5).close()
        rss = psutil.Process().memory_info().rss
        cap = rss + 80 * MiB + 112 * MiB  # the lock is free
        ok = KVServer(dataclasses.replace(cfg, http_port=None, capacity_bytes=cap))
        await ok.start()
        await ok.shutdown()

    asyncio.run(scenario())
