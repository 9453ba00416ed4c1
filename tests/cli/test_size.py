import json
import subprocess
import sys

import pytest

from kvport.cli.main import main


def run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvport.cli.main", *args], capture_output=True, text=True)


def test_size_example_json() -> None:
    p = run_cli(["size", "--model", "llama-3.1-8b", "--tokens", "65536", "--dtype", "fp16",
                 "--bandwidth", "20GiB/s", "--memory", "80GiB", "--json"])
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["kv_bytes"] == 8589934592
    assert d["ideal_transfer_seconds"] == pytest.approx(0.4)
    assert d["bytes_per_token"] == 131072
    assert d["tokens_fitting"] == 80 * 1024**3 // 131072


def test_size_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "--model", "llama-3.1-8b", "--tokens", "65536", "--dtype", "fp16",
                 "--bandwidth", "20GiB/s"]) == 0
    out = capsys.readouterr().out
    assert "8.00 GiB" in out and "400.000 ms" in out


@pytest.mark.parametrize("args", [
    ["--model", "nope", "--tokens", "10"],
    ["--model", "llama-3.1-8b", "--tokens", "0"],
    ["--model", "llama-3.1-8b", "--tokens", "-5"],
    ["--model", "llama-3.1-8b", "--tokens", "10", "--bandwidth", "fast"],
    ["--model", "llama-3.1-8b", "--tokens", "10", "--memory", "12 parsecs"],
    ["--model", "llama-3.1-8b", "--tokens", "10", "--dtype", "int3"],
    ["--model", "/nonexistent/config.json", "--tokens", "10"],
])
def test_user_errors_exit_2_without_traceback(args: list[str]) -> None:
    p = run_cli(["size", *args])
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and p.stderr.strip()
