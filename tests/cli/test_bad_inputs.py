"""Every bad CLI input is one line on stderr naming the flag, exit code 2, no traceback (issue 17, defect 12).

``serve`` runs as its own process (``python -m kvport.cli.serve_cmd``): a bad input that the server
accepts would start it, and the test then fails on the timeout instead of hanging.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvport.cli.main import main

# a small server: the host pool is what the capacity leaves after ~60 MB of baseline and the staging
SMALL = ["--listen", "127.0.0.1:0", "--capacity", "192MiB", "--max-value", "8MiB", "--inflight", "16MiB"]


def serve(*args: str, env: dict[str, str] | None = None, command: str = "serve") -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", f"kvport.cli.{command}_cmd", *args], capture_output=True,
                              text=True, timeout=60, env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired as exc:  # the process is killed by subprocess.run
        pytest.fail(f"kvport {command} {' '.join(args)} started instead of refusing: {exc.stdout!r}")


def assert_one_line_error(rc: int, err: str, *words: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    line = err.strip()
    assert line and "\n" not in line, err
    assert line.startswith("kvport: error: "), line
    for w in words:
        assert w in line, line


@pytest.fixture
def busy_port() -> Iterator[int]:
    s = socket.create_server(("127.0.0.1", 0))
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()


# ------------------------------------------------------------------ serve: start-up errors
def test_serve_http_port_in_use(busy_port: int) -> None:
    p = serve(*SMALL, "--http-port", str(busy_port))
    assert_one_line_error(p.returncode, p.stderr, "--http-port", str(busy_port), "in use")


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_http_port_out_of_range(port: str) -> None:
    p = serve(*SMALL, "--http-port", port)
    assert_one_line_error(p.returncode, p.stderr, "--http-port")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc (a folder nothing may create in)")
def test_serve_disk_folder_that_cannot_be_created() -> None:
    p = serve(*SMALL, "--disk", "/proc/kvport-test/disk")
    assert_one_line_error(p.returncode, p.stderr, "--disk", "/proc/kvport-test/disk")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes a read-only folder")
def test_serve_disk_folder_read_only(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        p = serve(*SMALL, "--disk", str(ro))
    finally:
        ro.chmod(0o755)
    assert_one_line_error(p.returncode, p.stderr, "--disk", str(ro))


def test_serve_disk_that_is_a_file_parent(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    p = serve(*SMALL, "--disk", str(tmp_path / "f" / "disk"))
    assert_one_line_error(p.returncode, p.stderr, str(tmp_path / "f"))


def test_serve_capacity_the_machine_cannot_allocate() -> None:
    p = serve("--listen", "127.0.0.1:0", "--capacity", "1e30")
    assert_one_line_error(p.returncode, p.stderr, "--capacity")


# ------------------------------------------------------------------ serve: values refused before start
@pytest.mark.parametrize(("args", "flag"), [
    (["--idle-timeout", "nan"], "--idle-timeout"),
    (["--idle-timeout", "0"], "--idle-timeout"),
    (["--frame-timeout", "inf"], "--frame-timeout"),
    (["--frame-timeout", "-1"], "--frame-timeout"),
    (["--capacity", "1e300GiB"], "--capacity"),
    (["--capacity", "0.4"], "--capacity"),
    (["--page-size", "0.5"], "--page-size"),
    (["--max-value", ""], "--max-value"),
    (["--disk-capacity", "1GiB"], "--disk-capacity"),  # without --disk it would size nothing
    (["--disk", ""], "--disk"),  # an empty path silently meant "no disk tier"
    (["--io-threads", "65"], "--io-threads"),
])
def test_serve_bad_values(args: list[str], flag: str) -> None:
    p = serve(*SMALL, *args)
    assert_one_line_error(p.returncode, p.stderr, flag)


def test_serve_disk_capacity_below_one_byte_is_not_the_default(tmp_path: Path) -> None:
    # parse_size("0.1") was 0, and `0 or 4 * capacity` made it the default: four times the capacity
    p = serve(*SMALL, "--disk", str(tmp_path / "d"), "--disk-capacity", "0.1")
    assert_one_line_error(p.returncode, p.stderr, "--disk-capacity", "less than one byte")


def test_serve_disk_capacity_below_one_page(tmp_path: Path) -> None:
    p = serve(*SMALL, "--disk", str(tmp_path / "d"), "--disk-capacity", "4KiB")
    assert_one_line_error(p.returncode, p.stderr, "--disk-capacity", "one page")


def test_serve_short_env_token_beyond_loopback() -> None:
    p = serve(*SMALL[2:], "--listen", "0.0.0.0:0", env={"KVPORT_AUTH_TOKEN": "x"})
    assert_one_line_error(p.returncode, p.stderr, "KVPORT_AUTH_TOKEN", "at least 8")


def test_serve_short_tenant_token_beyond_loopback(tmp_path: Path) -> None:
    f = tmp_path / "tenants.json"
    f.write_text('{"tenants": [{"name": "a", "token": "short"}]}')
    p = serve(*SMALL[2:], "--listen", "0.0.0.0:0", "--tenants", str(f))
    assert_one_line_error(p.returncode, p.stderr, "token", "at least 8")


def test_proxy_short_env_token_beyond_loopback() -> None:
    # the length kvport serve requires (issue 25, defect 11): the proxy accepted a 1-character token
    p = serve("--listen", "0.0.0.0:0", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
              env={"KVPORT_AUTH_TOKEN": "x"}, command="proxy")
    assert_one_line_error(p.returncode, p.stderr, "KVPORT_AUTH_TOKEN", "at least 8")


# ------------------------------------------------------------------ size
def test_size_memory_that_rounds_to_zero_bytes() -> None:
    p = subprocess.run([sys.executable, "-m", "kvport.cli.main", "size", "--model", "llama-3.1-8b", "--tokens", "10",
                        "--memory", "0.4"], capture_output=True, text=True)
    assert_one_line_error(p.returncode, p.stderr, "--memory", "0.4")
    assert p.stdout == ""


def test_size_memory_that_holds_no_token(capsys: pytest.CaptureFixture[str]) -> None:
    # 80 bytes (a unit left out): a capacity planner asked how many tokens fit must not answer "0" and succeed
    rc = main(["size", "--model", "llama-3.1-8b", "--tokens", "10", "--memory", "80"])
    out = capsys.readouterr()
    assert_one_line_error(rc, out.err, "--memory", "holds no token")
    assert out.out == ""


def test_size_memory_of_one_token_fits_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "--model", "llama-3.1-8b", "--tokens", "10", "--memory", "128KiB", "--json"]) == 0
    assert '"tokens_fitting": 1' in capsys.readouterr().out


# ------------------------------------------------------------------ every command, in-process
@pytest.mark.parametrize(("args", "flag"), [
    (["size", "--model", "llama-3.1-8b", "--tokens", "10", "--memory", "1e300GiB"], "--memory"),
    (["size", "--model", "llama-3.1-8b", "--tokens", "10", "--bandwidth", "1e300GiB/s"], "--bandwidth"),
    (["size", "--model", "llama-3.1-8b", "--tokens", "10", "--bandwidth", "1e-300GiB/s"], "--bandwidth"),
    (["size", "--model", "llama-3.1-8b", "--tokens", "10", "--block-size", "0"], "--block-size"),
    (["size", "--model", "llama-3.1-8b", "--tokens", "abc"], "--tokens"),
    (["size", "--model", "llama-3.1-8b"], "--tokens"),
    (["plan", "--model", "llama-3.1-8b", "--tokens", "100", "--cached", "50", "--latency", "nan"], "--latency"),
    (["plan", "--model", "llama-3.1-8b", "--tokens", "100", "--cached", "50", "--latency", "0.01"], "--latency"),
    (["plan", "--model", "llama-3.1-8b", "--tokens", "100", "--cached", "50", "--bandwidth", "bogus"], "--bandwidth"),
    (["plan", "--model", "llama-3.1-8b", "--tokens", "100", "--cached", "-5"], "--cached"),
    (["inspect", "--server", "127.0.0.1:99999"], "--server"),
    (["doctor", "--redis-url", "bogus"], "--redis-url"),
    (["demo", "--users", "0"], "--users"),
    (["serve", "--http-port", "99999"], "--http-port"),
    (["demo", "--engine", "tgi"], "--engine"),
    (["proxy", "--prefill", "ftp://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "--prefill"),
    (["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "127.0.0.1:2"], "--decode"),
    (["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--listen", "0.0.0.0:8000"],
     "--listen"),
    (["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--prefill-timeout", "nan"],
     "--prefill-timeout"),
    (["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--body-timeout", "inf"],
     "--body-timeout"),
    (["proxy", "--decode", "http://127.0.0.1:2"], "--prefill"),
    (["proxy", "--prefill", "http://127.0.0.1:1"], "--decode"),
    (["proxy", "--engine", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "--engine"),
    (["proxy", "--engine", "http://127.0.0.1:1", "--route", "sticky"], "--route"),
])
def test_bad_values_one_line_naming_the_flag(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(args)
    assert_one_line_error(rc, capsys.readouterr().err, flag)


@pytest.mark.parametrize(("args", "flag"), [
    (["proxy", "--engine", "http://127.0.0.1:1", "--kv-events", "http://127.0.0.1:9=tcp://x:1"], "KV event"),
    (["proxy", "--engine", "http://127.0.0.1:1", "--kv-events", "http://127.0.0.1:1=udp://x"], "KV event"),
    (["proxy", "--engine", "http://127.0.0.1:1", "--route-profile", "pyproject.toml"], "--route-profile"),
    (["proxy", "--engine", "http://127.0.0.1:1", "--kv-events", "http://127.0.0.1:1=tcp://127.0.0.1"], "KV event"),
    (["proxy", "--engine", "http://127.0.0.1:1", "--kv-events", "http://127.0.0.1:1=ipc:///a",
      "--kv-events", "http://127.0.0.1:1=ipc:///b"], "two KV event sources"),
    (["proxy", "--engine", "http://127.0.0.1:1", "--route-stale", "0.01"], "route_stale_s"),
])
def test_bad_route_values_one_line(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The proxy's own checks (its config needs aiohttp: the vllm extra)."""
    pytest.importorskip("aiohttp")
    rc = main(args)
    assert_one_line_error(rc, capsys.readouterr().err, flag)


def test_inspect_tls_ca_that_is_not_a_certificate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    rc = main(["inspect", "--server", "127.0.0.1:1", "--tls", "--tls-ca", str(ca)])
    assert_one_line_error(rc, capsys.readouterr().err, "--tls-ca")


def test_bench_json_path_that_cannot_be_written_fails_before_the_run(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("")
    rc = main(["bench", "hash", "--quick", "--json", str(tmp_path / "f" / "report.json")])
    out = capsys.readouterr()
    assert_one_line_error(rc, out.err, "--json")
    assert out.out == ""  # refused before the suite ran


def test_bench_json_path_check_leaves_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sub" / "report.json"
    assert main(["bench", "nosuch", "--json", str(path)]) == 2
    assert not path.exists()


def test_kvport_alone_still_shows_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    main([])
    out = capsys.readouterr()
    assert "Commands:" in out.out + out.err
