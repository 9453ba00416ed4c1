"""Read a config file: parse, check every key, apply ``KVPORT_*`` variables, check across keys, build.

Order of precedence, highest first: a flag or key given explicitly to an entry point (applied there),
a ``KVPORT_*`` variable, the file, the entry point's default. Every problem is collected before
anything is built, so one run of ``kvport config check`` names them all::

    kvport.toml:4: server.capacity: unknown size unit 'gigs' in '8 gigs': expected one of B, kB, ...
    kvport.toml:9: tiers.dsk: unknown key (did you mean 'disk'?)
    environment: KVPORT_LIMITS_INFLIGHT (limits.inflight): size must be positive, got '0'
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvport.config import environ
from kvport.configfile.checks import check_across
from kvport.configfile.keys import FIELDS, KEYS
from kvport.configfile.reader import ROLES, FileReader
from kvport.configfile.schema import (
    DiskSection,
    HostSection,
    KVPortConfig,
    LifetimesSection,
    LimitsSection,
    LinksSection,
    Problem,
    RemoteSection,
    ServerSection,
    TiersSection,
    TlsFiles,
)
from kvport.deadline import DeadlinePolicy
from kvport.errors import ConfigError


class ConfigFileError(ConfigError):
    """A config file (or its ``KVPORT_*`` variables) with problems: every one, in ``problems``."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = tuple(problems)
        head = problems[0].file if problems else "config"
        super().__init__(f"{head}: {len(problems)} problem(s):\n" + "\n".join(f"  {p}" for p in problems))


MAX_FILE_BYTES = 1 << 20  # a config file is kilobytes: anything larger (or /dev/zero) is refused unread

def load_config(path: Path | str | None, env: Mapping[str, str] | None = None, role: str = "all") -> KVPortConfig:
    """The file at ``path`` (None: no file) with ``KVPORT_*`` variables applied; raises
    :class:`ConfigFileError` naming every problem. ``env``: the variables (default: this process's,
    through :func:`kvport.config.environ`). ``role`` (:data:`kvport.configfile.ROLES`): which checks
    of this machine apply (``engine``: no server tokens, TLS files, server RAM or disk)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    e = environ() if env is None else env
    file = None if path is None else Path(path)
    text = ""
    if file is not None:
        try:
            with open(file, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes: not a config file")
            text = raw.decode("utf-8")
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            raise ConfigFileError([Problem(str(file), None, "(file)", f"cannot read: {exc}")]) from exc
    r = FileReader(file, text, e, role)
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        raise ConfigFileError([Problem(str(file), None, "(syntax)", "nested too deeply")]) from None
    except tomllib.TOMLDecodeError as exc:
        at = re.search(r"at line (\d+)", str(exc))  # Python < 3.14 keeps the line only in the message
        line = int(at.group(1)) if at else None
        raise ConfigFileError([Problem(str(file), line, "(syntax)", f"not valid TOML: {exc}")]) from exc
    r.walk(doc, ())
    r.overrides()
    check_across(r, file)
    r.problems.sort(key=lambda p: (p.file == "environment", p.line or 0))  # in the order of the file
    errors = [p for p in r.problems if not p.warning]
    if errors:
        raise ConfigFileError(errors)
    return _build(r, file)


def _build(r: FileReader, file: Path | None) -> KVPortConfig:
    v = r.values
    part: dict[str, dict[str, Any]] = {}
    for key, (section, name) in FIELDS.items():
        if key in v:
            part.setdefault(section, {})[name] = v[key]
    cert, tls_key = v.get("server.tls.cert"), v.get("server.tls.key")
    tls = TlsFiles(cert, tls_key) if cert is not None and tls_key is not None else None
    server = ServerSection(**part.get("server", {}), auth_token=v["server.token"], tls=tls)
    tiers = TiersSection(HostSection(**part.get("host", {})), DiskSection(**part.get("disk", {})),
                         RemoteSection(**part.get("remote", {})))
    given = frozenset(k for k in v if k in KEYS) | ({"tenants"} if "tenants" in v else set())
    if v["server.token"] is not None:
        given |= {"server.auth_token"}
    return KVPortConfig(
        source=file, server=server, tiers=tiers, links=LinksSection(**part.get("links", {})),
        eviction=v.get("eviction.policy"), lifetimes=LifetimesSection(**part.get("lifetimes", {})),
        limits=LimitsSection(**part.get("limits", {})), tenants=v.get("tenants"),
        load_deadline=v.get("load_deadline", DeadlinePolicy()), given=given,
        warnings=tuple(p for p in r.problems if p.warning))
