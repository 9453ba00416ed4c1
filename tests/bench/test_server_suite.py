import json

from kvport.cli.main import main

MiB = 1 << 20


def test_server_suite_report_shape(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A shrunken run (small capacity, 1 s steady phase, a quarter-capacity overload): shape, not speed."""
    path = tmp_path / "server.json"
    args = ["bench", "server", "--quick", "--json", str(path), "--set", f"capacity_bytes={448 * MiB}",
            "--set", f"inflight_bytes={64 * MiB}", "--set", "steady_s=1", "--set", "overload_factor=0.25",
            "--set", "client_processes=2"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(path.read_text())
    assert printed == saved and saved["suite"] == "server"
    assert set(saved) == {"format", "suite", "conditions", "limits", "results"}
    assert saved["conditions"]["clients"] == 16 and saved["conditions"]["capacity_bytes"] == 448 * MiB
    lim = saved["limits"]
    each = [x for x in lim["raw_socket_gbps_each"] if x is not None]
    assert len(lim["raw_socket_gbps_each"]) == 3  # --quick: 2 steady windows, measured before and after each
    assert lim["raw_socket_gbps"] == round(sorted(each)[len(each) // 2], 4)  # the median of them
    r = saved["results"]
    for k in ("throughput_vs_raw_socket", "p50_ms", "p99_ms", "lost_or_corrupt", "peak_memory_vs_capacity"):
        assert k in r
    assert r["lost_or_corrupt"] == 0 and r["client_errors"] == [] and r["server_exit_code"] == 0
    assert r["ops_steady"] > 0 and r["server_peak_rss_bytes"] > 0
