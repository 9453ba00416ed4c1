"""``kvport bench soak`` (shrunken: 15 s, a kill every 4 s, the server restarted half way): nothing
leaks, nothing committed is lost, every engine frees what it held."""

import json

from kvport.cli.main import main

MiB = 1 << 20


def test_soak_leaks_nothing_and_loses_nothing(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "soak.json"
    assert main(["bench", "soak", "--quick", "--json", str(path), "--set", "minutes=0.25", "--set", "kill_every_s=4",
                 "--set", f"capacity_bytes={256 * MiB}"]) == 0
    r = json.loads(path.read_text())["results"]
    assert json.loads(capsys.readouterr().out)["suite"] == "soak"
    assert r["clients_killed"] >= 2 and r["server_restarts"] == 1 and r["server_exit_codes"] == [0, 0]
    assert r["ops"] > 0 and r["transfers_committed"] > 0
    for k in ("leaked_pins", "leaked_leases", "blocks_without_owner", "orphan_children", "lost_committed",
              "engine_blocks_owned_at_end"):
        assert r[k] == 0, (k, r)
    assert r["peak_memory_vs_capacity"] <= 1.1
