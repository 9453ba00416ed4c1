"""The typed objects a config file becomes (frozen; built only by :func:`kvport.configfile.load_config`).

Every field has the default the entry points use when the file leaves it out; ``KVPortConfig.given``
names the keys the file or a ``KVPORT_*`` variable did set, so an entry point applies those only
and keeps its own default (and its explicit flags or keys) for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvport.deadline import DeadlinePolicy

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong (or, ``warning``, worth saying) in a config file or a ``KVPORT_*`` variable."""

    file: str  # the file's path, or "environment"
    line: int | None
    key: str  # dotted (``tenants[1].quota``), or the variable's name
    reason: str
    warning: bool = False

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.reason}"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class ServerSection:
    """``[server]``: the ``kvport serve`` process (its own host pool and disk folder)."""

    listen: tuple[str, int] = ("127.0.0.1", 7878)
    http_port: int | None = None
    capacity_bytes: int = 8 * GiB  # the whole process's memory budget
    disk_dir: Path | None = None
    disk_capacity_bytes: int | None = None  # None: 4 x capacity
    page_bytes: int = MiB
    io_threads: int = 4
    spill_on_shutdown: bool = True
    prefault: bool = False  # fault the host pool in at start (else resident as it fills)
    auth_token: str | None = field(default=None, repr=False)  # the default tenant's (no [[tenants]])
    tls: TlsFiles | None = None


@dataclass(frozen=True, slots=True)
class HostSection:
    capacity_bytes: int = 0  # 0: none
    codec: str = "raw"


@dataclass(frozen=True, slots=True)
class DiskSection:
    path: Path | None = None
    capacity_bytes: int = 8 * GiB
    codec: str = "raw"


@dataclass(frozen=True, slots=True)
class RemoteSection:
    server: tuple[str, int] | None = None  # a kvport serve
    redis: str | None = None  # a Redis / Valkey URL (?cluster=true: a Redis Cluster)
    tenant: str = "default"
    write: str = "behind"  # or "through"
    codec: str = "raw"


@dataclass(frozen=True, slots=True)
class TiersSection:
    """``[tiers.*]``: the engines' store, top to bottom (the connectors, the demo's workers)."""

    host: HostSection = field(default_factory=HostSection)
    disk: DiskSection = field(default_factory=DiskSection)
    remote: RemoteSection = field(default_factory=RemoteSection)


@dataclass(frozen=True, slots=True)
class LinksSection:
    handoff_codec: str = "raw"  # prefill -> decode streams (fixed-size codecs only)


@dataclass(frozen=True, slots=True)
class LifetimesSection:
    request_ttl_s: float = 60.0
    session_ttl_s: float = 600.0


@dataclass(frozen=True, slots=True)
class LimitsSection:
    max_value_bytes: int = 64 * MiB
    inflight_bytes: int = 256 * MiB
    max_connections: int = 1024
    max_pending: int = 64
    max_per_peer: int = 256
    per_peer_exempt: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    idle_timeout_s: float = 120.0
    frame_timeout_s: float = 30.0
    write_timeout_s: float = 10.0
    handshake_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """One ``[[tenants]]`` table: what :class:`kvport.server.tenants.Tenant` is built from."""

    name: str
    token: str | None = field(default=None, repr=False)
    quota_bytes: int | None = None
    admin: bool = False


@dataclass(frozen=True, slots=True)
class KVPortConfig:
    source: Path | None = None  # the file (None: defaults and KVPORT_* variables only)
    server: ServerSection = field(default_factory=ServerSection)
    tiers: TiersSection = field(default_factory=TiersSection)
    links: LinksSection = field(default_factory=LinksSection)
    eviction: str | None = None  # a name of kvport.store.eviction.POLICIES; None: the entry point's default
    lifetimes: LifetimesSection = field(default_factory=LifetimesSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    tenants: tuple[TenantEntry, ...] | None = None  # None: no [[tenants]] (one default tenant)
    load_deadline: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    given: frozenset[str] = frozenset()  # dotted keys set by the file or a KVPORT_* variable
    warnings: tuple[Problem, ...] = ()

    def sets(self, key: str) -> bool:
        return key in self.given
