"""One typed configuration, built once from environment variables (``KVPORT_*``) and flags.

This is the only module of kvport that reads or sets ``os.environ``. Everything receives a
:class:`Settings` (or one of its small value objects) explicitly, but for ``KVPORT_MEMOPS``, which
:mod:`kvport.memops` asks for (:func:`memops_choice`) at its import, so that the choice holds in
every process before anything hashes or copies.

==========================  =====================================================  ===========================
variable                    meaning                                                default
==========================  =====================================================  ===========================
KVPORT_HOME                 cache folder (converted reference model, profiles)      ~/.cache/kvport
KVPORT_MODEL_DIR            converted reference model folder (HF format)            $KVPORT_HOME/models/smollm2
KVPORT_PROFILE              calibration profile path                                $KVPORT_HOME/profile.json
KVPORT_REDIS_URL            Redis tier URL                                          (none)
KVPORT_AUTH_TOKEN           shared secret for non-loopback servers                  (none)
KVPORT_PD_SECRET            the shared secret of a PD deployment's hand-off links   KVPORT_AUTH_TOKEN
                            (every decode engine's inbox; >= 16 bytes; kvport's
                            deployments generate one per deployment)
KVPORT_LOG_LEVEL            logging level                                           WARNING
KVPORT_TRACE_DIR            folder of benchmark traces (``bench trace``)            <checkout>/../shared/traces
KVPORT_LOAD_DEADLINE        a load's deadline: ``MIN_S:FACTOR:MAX_S`` -- FACTOR x   1:4:30
                            the planner's expected load time, within [MIN_S, MAX_S]
KVPORT_MEMOPS               the memory kernels of a whole process tree: avx512,    the widest this
                            avx2, portable or fallback (numpy + xxhash)             CPU runs
KVPORT_<SECTION>_<KEY>      any key of a config file (``kvport serve --config``,    the file's
                            docs/kvport.example.toml), e.g. KVPORT_SERVER_CAPACITY,
                            KVPORT_LIMITS_MAX_VALUE: overrides the file
==========================  =====================================================  ===========================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvport.deadline import DeadlinePolicy
from kvport.errors import ConfigError

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MIN_TOKEN_CHARS = 8  # a token that guards a listener beyond loopback (kvport serve, tenants, kvport proxy)


@dataclass(frozen=True, slots=True)
class Settings:
    home: Path
    model_dir: Path
    profile_path: Path
    redis_url: str | None = None
    auth_token: str | None = field(default=None, repr=False)
    pd_secret: str | None = field(default=None, repr=False)
    log_level: str = "WARNING"
    trace_dir: Path | None = None
    load_deadline: DeadlinePolicy = field(default_factory=DeadlinePolicy)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        home = Path(e.get("KVPORT_HOME") or Path.home() / ".cache" / "kvport").expanduser()
        level = e.get("KVPORT_LOG_LEVEL", "WARNING").upper()
        if level not in _LEVELS:
            raise ConfigError(f"KVPORT_LOG_LEVEL={level!r}: expected one of {', '.join(_LEVELS)}")
        return cls(
            home=home,
            model_dir=Path(e.get("KVPORT_MODEL_DIR") or home / "models" / "smollm2-135m-instruct"),
            profile_path=Path(e.get("KVPORT_PROFILE") or home / "profile.json"),
            redis_url=e.get("KVPORT_REDIS_URL") or None,
            auth_token=e.get("KVPORT_AUTH_TOKEN") or None,
            pd_secret=e.get("KVPORT_PD_SECRET") or e.get("KVPORT_AUTH_TOKEN") or None,
            log_level=level,
            trace_dir=Path(e["KVPORT_TRACE_DIR"]).expanduser() if e.get("KVPORT_TRACE_DIR") else None,
            load_deadline=_deadline_policy(e.get("KVPORT_LOAD_DEADLINE")),
        )


def _deadline_policy(text: str | None) -> DeadlinePolicy:
    if not text:
        return DeadlinePolicy()
    try:
        return DeadlinePolicy.parse(text)
    except ConfigError as exc:
        raise ConfigError(f"KVPORT_LOAD_DEADLINE={text!r}: {exc}") from None


def memops_choice() -> str | None:
    """``KVPORT_MEMOPS``, lower case (None: unset); :mod:`kvport.memops` checks the name."""
    return os.environ.get("KVPORT_MEMOPS", "").strip().lower() or None


def environ() -> dict[str, str]:
    """A copy of this process's variables, for :func:`kvport.configfile.load_config`: its ``KVPORT_*``
    overrides of a config file's keys (``KVPORT_`` + the key's dotted path in capitals, ``.`` as ``_``,
    e.g. ``KVPORT_SERVER_CAPACITY``) and the variables a file names for its tokens (``auth_token_env``)."""
    return dict(os.environ)


def export(variables: Mapping[str, str]) -> None:
    """Set ``variables`` in this process's environment, for the processes it starts
    (:func:`subprocess_env` copies it): ``kvport demo --config`` hands its file's keys to its servers so."""
    os.environ.update(variables)


@contextlib.contextmanager
def exported(variables: Mapping[str, str | None]) -> Iterator[None]:
    """:func:`export` for a block: ``variables`` set (None: unset) inside it, each as it was after (a
    benchmark picking UCX's transports for one of its runs)."""
    old = {k: os.environ.get(k) for k in variables}
    _assign(variables)
    try:
        yield
    finally:
        _assign(old)


def _assign(variables: Mapping[str, str | None]) -> None:
    for k, v in variables.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def subprocess_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of this process's environment for child processes (workers, servers, vLLM)."""
    env = dict(os.environ)
    if extra:
        env.update(extra)
    return env
