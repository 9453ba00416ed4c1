import json

from kvport.cli.main import main


def test_tiers_suite_report_shape(capsys, redis_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVPORT_REDIS_URL", redis_server.url)
    assert main(["bench", "tiers", "--quick", "--set", "tokens=32", "--set", "trials=1"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["suite"] == "tiers"
    assert set(rep) == {"format", "suite", "conditions", "limits", "results"}
    for f in ("llama_memcpy_gbps", "llama_raw_disk_write_gbps", "llama_raw_disk_read_gbps",
              "llama_raw_redis_set_gbps", "llama_raw_redis_get_gbps", "smollm2_memcpy_gbps"):
        assert rep["limits"][f] > 0, f
    for f in ("host_put_vs_memcpy", "host_get_vs_memcpy", "disk_write_vs_raw", "disk_read_vs_raw",
              "redis_put_vs_raw", "redis_get_vs_raw"):
        assert rep["results"][f] > 0, f
        assert f"smollm2_{f}" in rep["results"]
    assert rep["results"]["llama_bytes_round_trip_exact"] is True
    assert rep["results"]["smollm2_bytes_round_trip_exact"] is True
    assert rep["limits"]["llama_bytes"] == 32 * 131072
