"""The core works without torch, numba, transformers or vLLM; an optional part says which extra to install.

Each test runs in a child interpreter where those packages cannot be imported (:mod:`.blocked`), so
it checks the same thing in the full dev venv as in the core-only venvs of ``make wheelcheck``.
"""

from __future__ import annotations

import json

import pytest

from tests.packaging.blocked import OPTIONAL, run_blocked, run_cli_blocked


def test_core_packages_import_without_optional_packages() -> None:
    p = run_blocked(
        "import kvport.tiers, kvport.store, kvport.ledger, kvport.transfer, kvport.server, kvport.protocol, "
        "kvport.client, kvport.codec, kvport.planner, kvport.cli.main, kvport.cli.serve_cmd, kvport.cli.inspect_cmd, "
        "kvport.cli.doctor_cmd\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r}))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


@pytest.mark.parametrize("codec_id", ["raw", "lossless"])
def test_raw_and_lossless_codecs_run_on_numpy_alone(codec_id: str) -> None:
    p = run_blocked(
        "import numpy as np\n"
        "from kvport.codec import get_codec\n"
        "rng = np.random.default_rng(0)\n"
        "k = rng.standard_normal((2, 3, 17, 64), dtype=np.float32); v = k * 3\n"
        "for bf16 in (False, True):\n"
        "    kk, vv = (k.view(np.uint16)[..., ::2].copy(), v.view(np.uint16)[..., ::2].copy()) if bf16 else (k, v)\n"
        f"    c = get_codec({codec_id!r}); enc = c.encode(kk, vv)\n"
        "    ko, vo = np.empty_like(kk), np.empty_like(vv); c.decode(enc, ko, vo)\n"
        "    assert (ko == kk).all() and (vo == vv).all()\n"
        "print('ok')")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


@pytest.mark.parametrize(("code", "extra"), [
    ("from kvport.codec import get_codec; get_codec('int8')", "codecs"),
    ("from kvport.codec import get_codec; get_codec('mixed')", "codecs"),
    ("import kvport.codec.kivi4", "codecs"),
    ("import kvport.engines.hf", "hf"),
    ("from kvport.engines.hf.engine import HFEngine", "hf"),
    ("import kvport.eval", "eval"),
    ("import kvport.engines.vllm.connector", "vllm"),
])
def test_an_optional_part_raises_one_error_naming_its_extra(code: str, extra: str) -> None:
    p = run_blocked(
        "from kvport.errors import MissingExtraError\n"
        f"try:\n    {code}\n"
        "except MissingExtraError as exc:\n    print(exc.extra); print(exc)\n")
    assert p.returncode == 0, p.stderr
    got_extra, message = p.stdout.strip().splitlines()
    assert got_extra == extra
    assert message.endswith(f"pip install 'kvport[{extra}]'"), message


@pytest.mark.parametrize(("args", "extra"), [
    (["eval", "quality", "--codec", "int8", "--windows", "1"], "eval"),
    (["calibrate"], "hf"),
    (["demo"], "hf"),
    (["bench", "codec", "--quick"], "hf"),
])
def test_a_command_without_its_extra_prints_one_line(args: list[str], extra: str) -> None:
    p = run_cli_blocked(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    line = p.stderr.strip()
    assert "\n" not in line and line.startswith("kvport: error: "), line
    assert f"pip install 'kvport[{extra}]'" in line


@pytest.mark.parametrize("args", [["--help"], ["size", "--model", "llama-3.1-8b", "--tokens", "16", "--json"],
                                  ["serve", "--help"], ["inspect", "--help"], ["doctor", "--help"]])
def test_core_commands_run_without_optional_packages(args: list[str]) -> None:
    p = run_cli_blocked(*args)
    assert p.returncode == 0, p.stderr
    if "--json" in args:
        assert json.loads(p.stdout)["kv_bytes"] > 0
