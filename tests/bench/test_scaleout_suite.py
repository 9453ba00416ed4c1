"""``kvport bench scaleout --quick`` on real Redis Clusters it starts itself: the tier's throughput next to
raw RedisCluster in the same run; a primary killed while its replica is behind: no read ever returns
other bytes, and with WAIT no acknowledged value is lost; slots moved while serving lose nothing; across an
emulated link (two network namespaces), kvport's transfer against raw sockets, the planner over it, and
vLLM PD across it with the proxy choosing stream or recompute per request."""

import json

import pytest

from kvport.cli.main import main
from kvport.evidence.netlink import unavailable
from kvport.transfer import nixl


@pytest.mark.slow
@pytest.mark.redis
def test_scaleout_quick_reports_the_cluster_against_raw_and_its_faults(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "scaleout.json"
    args = ["--quick", "--set", "values=16", "--set", "links=1g-1ms", "--json", str(path)]
    assert main(["bench", "scaleout", *args]) == 0
    report = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out) == report and report["suite"] == "scaleout"
    res, lim = report["results"], report["limits"]
    no_links, no_nixl = unavailable(), nixl.available()
    assert set(res["reasons"]) == ({"nixl_vs_bare_nixl", "nixl_tcp_vs_raw_socket"} if no_nixl else set()) | \
        ({"links"} if no_links else set())  # every part that can run here ran
    assert lim["raw_cluster_set_gbps"] > 0 and lim["raw_cluster_get_gbps"] > 0
    assert res["redis_cluster_bytes_exact"] is True
    assert res["redis_cluster_put_vs_raw"] > 0 and res["redis_cluster_get_vs_raw"] > 0
    f = res["failover"]
    assert f["wrong_outputs"] == 0
    assert f["acknowledged_lost_with_wait"] == 0 and f["acknowledged_with_wait"] > 0
    assert f["recovery_seconds"] is not None and f["recovery_seconds_with_wait"] is not None
    r = res["reshard"]
    assert r["wrong_outputs"] == 0 and r["lost"] == 0 and r["acknowledged"] > 0
    if no_nixl:
        assert res["nixl_vs_bare_nixl"] is None and "nixl" in res["reasons"]["nixl_vs_bare_nixl"]
    else:  # kvport over NIXL next to bare NIXL and raw sockets, same bytes, same run
        assert res["nixl_vs_bare_nixl"] > 0 and res["nixl_tcp_vs_raw_socket"] > 0
        assert res["nixl"]["tcp"]["raw_socket_gbps"] > 0 and res["nixl"]["default"]["verify_gbps"] > 0
    if no_links is None:
        lk = res["links"]["1g-1ms"]
        assert set(res["links"]) == {"1g-1ms"} and lk["link"]["rate_mbit"] == 1000
        assert lk["transfer_vs_raw_socket"] > 0 and lk["transfer_vs_ideal"] > 0 and lk["ideal_s"] > 0
        assert lk["planner_cells"] > 0 and lk["planner_within_10pct"] is not None
        # vLLM PD across the link: prefill engine in one namespace, decode engine and the planning proxy in
        # the other; every hand-off streamed across it loaded (none recomputed), the same answers on every path
        assert lk["pd_ttft_vs_best_option"] > 0 and lk["pd_tokens_equal"] is True, lk.get("pd_reason")
        assert lk["pd_streamed_tokens_loaded"] == 1.0
        assert {r["planner_choice"] for r in lk["pd_lengths"]} <= {"stream", "recompute"}
        assert lk["pd_crossover_tokens"]["predicted_after_calibration"] is not None
