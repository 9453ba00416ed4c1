"""``kvport bench scaleout --quick`` on real Redis Clusters it starts itself: the tier's throughput next to
raw RedisCluster in the same run; a primary killed while its replica is behind: no read ever returns
other bytes, and with WAIT no acknowledged value is lost; slots moved while serving lose nothing."""

import json

import pytest

from kvport.cli.main import main


@pytest.mark.slow
@pytest.mark.redis
def test_scaleout_quick_reports_the_cluster_against_raw_and_its_faults(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "scaleout.json"
    assert main(["bench", "scaleout", "--quick", "--set", "values=16", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out) == report and report["suite"] == "scaleout"
    res, lim = report["results"], report["limits"]
    assert set(res["reasons"]) == {"nixl_vs_bare_nixl", "nixl_tcp_vs_raw_socket", "links"}  # every cluster part ran
    assert lim["raw_cluster_set_gbps"] > 0 and lim["raw_cluster_get_gbps"] > 0
    assert res["redis_cluster_bytes_exact"] is True
    assert res["redis_cluster_put_vs_raw"] > 0 and res["redis_cluster_get_vs_raw"] > 0
    f = res["failover"]
    assert f["wrong_outputs"] == 0
    assert f["acknowledged_lost_with_wait"] == 0 and f["acknowledged_with_wait"] > 0
    assert f["recovery_seconds"] is not None and f["recovery_seconds_with_wait"] is not None
    r = res["reshard"]
    assert r["wrong_outputs"] == 0 and r["lost"] == 0 and r["acknowledged"] > 0
    assert res["nixl_vs_bare_nixl"] is None and "NIXL" in res["reasons"]["nixl_vs_bare_nixl"]
