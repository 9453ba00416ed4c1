"""``kvport bench soak`` (shrunken: 15 s, a kill every 4 s, the server restarted half way; then the
quick memory phases): nothing leaks, nothing committed is lost, every engine frees what it held,
and the server's RSS stays within --capacity plus its stated fixed overhead."""

import json

from kvport.cli.main import main

MiB = 1 << 20
PHASE_FIELDS = {"peak_rss_bytes", "rss_vs_capacity_plus_overhead", "peak_rss_vs_capacity", "growth_over_idle_bytes"}


def test_soak_leaks_nothing_and_loses_nothing(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "soak.json"
    assert main(["bench", "soak", "--quick", "--json", str(path), "--set", "minutes=0.25", "--set", "kill_every_s=4",
                 "--set", f"capacity_bytes={256 * MiB}"]) == 0
    doc = json.loads(path.read_text())
    r = doc["results"]
    assert json.loads(capsys.readouterr().out)["suite"] == "soak"
    assert set(doc["limits"]) == {"raw_socket_gbps"}
    assert r["clients_killed"] >= 2 and r["server_restarts"] == 1 and r["server_exit_codes"] == [0, 0]
    assert r["ops"] > 0 and r["transfers_committed"] > 0
    for k in ("leaked_pins", "leaked_leases", "blocks_without_owner", "orphan_children", "lost_committed",
              "engine_blocks_owned_at_end"):
        assert r[k] == 0, (k, r)
    assert r["peak_memory_vs_capacity"] <= 1.1

    m = r["memory"]
    assert m["capacity_bytes"] == 256 * MiB and m["server_exit_code"] == 0
    assert 0 < m["host_pool_bytes"] < m["idle_rss_bytes"] < m["capacity_bytes"]
    assert m["fixed_overhead_bytes"] == m["idle_rss_bytes"] - m["host_pool_bytes"]
    hits, flood = m["read_hits"], m["lease_flood"]
    assert hits["gets"] == hits["hits"] == 20_000 and hits["misses"] == 0 and hits["working_set_blocks"] > 0
    assert flood["ended_by"] == "budget" and flood["refused_by"]["budget"] > 0, flood
    assert flood["leases_granted"] > 0 and flood["pins_granted"] > 0 and flood["lease_blocks_granted"] > 0
    assert flood["leases_refused"] + flood["pins_refused"] == sum(flood["refused_by"].values())
    for phase in (hits, flood):
        assert set(phase) >= PHASE_FIELDS
        assert phase["peak_rss_bytes"] >= m["idle_rss_bytes"] * 0.9
        assert phase["rss_vs_capacity_plus_overhead"] <= 1.0, (phase, m)
