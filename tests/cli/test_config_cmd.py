"""``kvport config check`` and ``kvport serve --config``: flags over KVPORT_* variables over the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvport.cli.main import main
from kvport.protocol.rejects import Rejected, RejectReason
from tests.server.conftest import ServerProc

MiB = 1 << 20
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "kvport.example.toml"
TOKENS = {"CHAT_TOKEN": "chat-secret-token", "OPS_TOKEN": "ops-secret-token"}


def test_the_example_file_passes_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(EXAMPLE), "--no-env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {EXAMPLE}\n") and "tenants    one default tenant" in out
    # one file for serve and the engines: the tenant the engines log in as is one the server has
    from kvport.configfile import load_config

    server = load_config(EXAMPLE, role="server", env={})
    engine = load_config(EXAMPLE, role="engine", env={})
    names = {t.name for t in server.tenants} if server.tenants else {"default"}
    assert engine.tiers.remote.tenant in names


def test_check_names_every_problem_with_its_line_and_key_and_exits_2(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[server]\ncapacity = "8GB "\npage_size = "1 MB"\n\n[limits]\nmax_value = 0\n'
                    'inflight = "64 MiBs"\n[tiers.dsk]\npath = "/tmp"\n[[tenants]]\nname = "a/b"\n')
    with pytest.raises(SystemExit) as exc:
        main(["config", "check", str(path), "--no-env"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"{path}:3: server.page_size: must be a power of two, got 1000000",
        f"{path}:6: limits.max_value: size must be positive, got 0",
        f"{path}:7: limits.inflight: unknown size unit 'mibs' in '64 MiBs': expected one of B, kB, MB, GB, TB, KiB, "
        "MiB, GiB, TiB",
        f"{path}:8: tiers.dsk: unknown key (did you mean 'disk'?)",
        f"{path}:11: tenants[0].name: 'a/b': expected 1-64 printable characters, no '/'",
        f"kvport config check: 5 problems in {path}",
    ]


def test_serve_takes_its_capacity_limits_and_tenants_from_the_file(tmp_path: Path) -> None:
    """The file says port 7878, pages of 1 MiB, values up to 8 MiB; the flag (--listen, --max-value) and
    the variable (KVPORT_SERVER_PAGE_SIZE) given win; the rest (capacity, tenants, quotas) is the file's."""
    path = tmp_path / "kvport.toml"
    path.write_text('''[server]
listen = "127.0.0.1:7878"
capacity = "256MiB"
page_size = "1MiB"
http_port = 0
[limits]
max_value = "8MiB"
inflight = "16MiB"
[eviction]
policy = "lfu"
[[tenants]]
name = "chat"
token_env = "CHAT_TOKEN"
quota = "4MiB"
[[tenants]]
name = "ops"
token_env = "OPS_TOKEN"
admin = true
''')
    srv = ServerProc(["--config", str(path), "--listen", "127.0.0.1:0", "--max-value", "4MiB"],
                     env={**TOKENS, "KVPORT_SERVER_PAGE_SIZE": "512KiB"}).start()
    try:
        assert srv.port != 7878 and srv.info["http_port"] is not None
        assert srv.info["page_bytes"] == 512 << 10
        assert 0 < srv.info["host_capacity"] < 256 * MiB - 16 * MiB  # the file's process budget, not 8 GiB
        chat = srv.client("chat", TOKENS["CHAT_TOKEN"], backpressure_timeout_s=0.3)
        assert chat.caps.max_value_bytes == 4 * MiB
        for k in (b"a", b"b"):
            assert not isinstance(chat.put_value(k * 16, np.ones(2 * MiB, dtype=np.uint8), pin=True), Rejected)
        rej = chat.put_value(b"c" * 16, np.ones(MiB, dtype=np.uint8))
        assert isinstance(rej, Rejected) and rej.reason is RejectReason.QUOTA  # the file's 4 MiB quota
        chat.close()
        out = subprocess.run([sys.executable, "-m", "kvport.cli.main", "inspect", "--server", f"127.0.0.1:{srv.port}",
                              "--tenant", "ops", "--token", TOKENS["OPS_TOKEN"], "--json"],
                             capture_output=True, text=True, timeout=60, check=True)
        assert sorted(t["name"] for t in json.loads(out.stdout)["tenants"]) == ["chat", "ops"]
    finally:
        assert srv.stop() == 0


def test_serve_with_a_bad_file_starts_nothing_and_names_each_problem(tmp_path: Path) -> None:
    path = tmp_path / "kvport.toml"
    path.write_text('[server]\nlisten = "0.0.0.0:0"\ncapacity = "256MiB"\n[limits]\nmax_valu = "8MiB"\n')
    env = {k: v for k, v in os.environ.items() if k != "KVPORT_AUTH_TOKEN"}
    p = subprocess.run([sys.executable, "-m", "kvport.cli.serve_cmd", "--config", str(path)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert f"{path}:2: server.listen: listening on '0.0.0.0' (beyond loopback) needs a token" in p.stderr
    assert f"{path}:5: limits.max_valu: unknown key (did you mean 'max_value'?)" in p.stderr


def test_demo_checks_the_file_before_anything_starts_and_hands_its_keys_to_its_processes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvport.cli.demo_cmd import _apply_config
    from kvport.config import Settings

    bad = tmp_path / "bad.toml"
    bad.write_text('[eviction]\npolicy = "fifo"\n')
    assert main(["demo", "--config", str(bad)]) == 2
    assert f"{bad}:2: eviction.policy: 'fifo' is not one of" in capsys.readouterr().err
    good = tmp_path / "kvport.toml"
    good.write_text('load_deadline = "2:3:20"\n[eviction]\npolicy = "lfu"\n[lifetimes]\nsession_ttl_s = 90\n'
                    '[server]\ncapacity = "1GiB"\n')
    names = ("KVPORT_EVICTION_POLICY", "KVPORT_LIFETIMES_SESSION_TTL_S", "KVPORT_LIFETIMES_REQUEST_TTL_S",
             "KVPORT_LOAD_DEADLINE", "KVPORT_SERVER_CAPACITY")
    for name in names:  # restored after the test
        monkeypatch.setenv(name, "")
    _apply_config(str(good))
    assert {n: os.environ[n] for n in names} == {
        "KVPORT_EVICTION_POLICY": "lfu", "KVPORT_LIFETIMES_SESSION_TTL_S": "90.0", "KVPORT_LIFETIMES_REQUEST_TTL_S": "",
        "KVPORT_LOAD_DEADLINE": "2.0:3.0:20.0", "KVPORT_SERVER_CAPACITY": ""}  # the demo sizes its server itself
    dl = Settings.from_env().load_deadline
    assert (dl.min_s, dl.factor, dl.max_s) == (2.0, 3.0, 20.0)


def test_exported_variables_hold_inside_the_block_and_are_as_they_were_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvport.config import exported, memops_choice

    monkeypatch.setenv("KVPORT_TEST_SET", "before")
    monkeypatch.delenv("KVPORT_TEST_UNSET", raising=False)
    monkeypatch.setenv("KVPORT_MEMOPS", " AVX2 ")
    with exported({"KVPORT_TEST_SET": "inside", "KVPORT_TEST_UNSET": "new", "KVPORT_MEMOPS": None}):
        assert os.environ["KVPORT_TEST_SET"] == "inside" and os.environ["KVPORT_TEST_UNSET"] == "new"
        assert "KVPORT_MEMOPS" not in os.environ and memops_choice() is None
    assert os.environ["KVPORT_TEST_SET"] == "before" and "KVPORT_TEST_UNSET" not in os.environ
    assert memops_choice() == "avx2"
    with pytest.raises(RuntimeError), exported({"KVPORT_TEST_SET": "inside"}):
        raise RuntimeError
    assert os.environ["KVPORT_TEST_SET"] == "before"  # restored after a failure too
