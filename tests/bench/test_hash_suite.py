import json

from kvport.bench.harness import SuiteOptions
from kvport.cli.main import main


def test_hash_suite_report_shape(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "hash.json"
    assert main(["bench", "hash", "--quick", "--json", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(path.read_text())
    assert printed == saved
    assert set(saved) == {"format", "suite", "conditions", "limits", "results"}
    assert saved["suite"] == "hash"
    for k in ("cpu_count", "loadavg_start", "loadavg_end", "versions", "machine"):
        assert k in saved["conditions"]
    assert saved["limits"]["raw_xxh3_128_blocks_per_second_256"] > 0
    assert saved["results"]["blocks_per_second_256"] > 0
    assert saved["results"]["vs_raw_hash_256"] > 0


def test_unknown_suite_is_user_error(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "no-such-suite"]) == 2
    assert "expected one of" in capsys.readouterr().err
    assert SuiteOptions().quick is False
