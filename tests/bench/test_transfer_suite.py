import json

from kvport.cli.main import main


def test_transfer_suite_report_shape(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--quick", "--json", str(path), "--set", "mib=8", "--set", "trials=1",
            "--set", "overload_s=0.5"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(path.read_text())
    assert printed == saved
    assert set(saved) == {"suite", "conditions", "limits", "results"} and saved["suite"] == "transfer"
    for k in ("cpu_count", "loadavg_start", "loadavg_end", "versions", "process_layout"):
        assert k in saved["conditions"]
    for k in ("memcpy_gbps", "raw_socket_gbps", "raw_socket_same_layout_gbps"):
        assert saved["limits"][k] is None or saved["limits"][k] > 0
    r = saved["results"]
    for k in ("tcp_vs_raw_socket", "shm_vs_memcpy", "tcp_gbps", "shm_gbps"):
        assert r[k] > 0
    assert r["tcp_time"]["ideal_s"] > 0 and r["tcp_time"]["measured_s"] > 0
    for key in ("overload", "overload_no_backpressure"):
        for f in ("peak_memory_vs_budget", "lost_blocks", "goodput_vs_capacity"):
            assert f in r[key]
    assert r["overload"]["backpressure"] is True and r["overload_no_backpressure"]["backpressure"] is False
    assert r["overload"]["lost_blocks"] == 0 and r["overload"]["peak_memory_vs_budget"] <= 1.0
    assert r["layerwise"]["streamed_s"] > 0 and r["layerwise"]["sequential_s"] > 0
