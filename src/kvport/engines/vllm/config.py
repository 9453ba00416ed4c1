"""The connector's configuration, parsed once from vLLM's ``kv_connector_extra_config``.

Keys (all optional except a store location: a disk folder, Redis, a kvport server, or several)::

    kvport_disk_dir        folder of a kvport DiskTier shared by every engine process  (none)
    kvport_disk_capacity   "8 GiB" / bytes; the tier evicts above it                  (8 GiB)
    kvport_server          "HOST:PORT" of a ``kvport serve``: the shared tier at the
                           bottom of the store, every save written through to it;
                           its token comes from KVPORT_AUTH_TOKEN                      (none)
    kvport_redis           a Redis URL: a Redis / Valkey server or, with ?cluster=true,
                           a Redis Cluster (``redis://NODE:PORT/0?cluster=true``; also
                           ``&wait_replicas=1``: a save waits for a replica) as the
                           shared tier, below the disk folder, above a kvport server;
                           every save is copied to it like to the server             (none)
    kvport_server_write    "behind": a save returns once the tiers above the server hold
                           it, the server's copy is written by the store's write-behind
                           thread (kvport.store.behind); "through": the save waits for
                           it too. Only with a disk or host tier above the server    ("behind")
    kvport_server_tenant   the tenant this engine's blocks belong to on the server   ("default")
    kvport_host_capacity   "1 GiB" / bytes of a host-RAM tier in front (0: none)      (0)
    kvport_save_generated  also save the blocks of generated tokens, so the next
                           turn's prefill on any engine finds the whole conversation  (true)
    kvport_async_handoff   a decode engine loads a hand-off in the background
                           (vLLM's load_kv_async): other requests' steps go on      (true)
    kvport_pd_take         how a decode engine takes a streamed hand-off from its inbox:
                           "sync": in the request's first step, before its forward (the
                           prefill engine answered only after the stream committed,
                           so it is there; what is not there at once is recomputed);
                           "async": in the background, the request scheduled one
                           engine step later (it waits for a stream still arriving)   ("sync")
    kvport_pd_lease_s      a producer (kv_role kv_producer) leases a request's blocks
                           in the shared tier for this long when it hands them to a
                           decode engine; the decode engine's load must come by then  (30)
    kvport_pd_inbox        a decode engine (kv_consumer) listens here for hand-offs
                           streamed layer by layer during the prefill
                           (kvport.engines.vllm.stream): HOST:PORT (TCP), shm:NAME or nixl:HOST:PORT
                           (shared memory, producers on this host). Every connection
                           authenticates with KVPORT_PD_SECRET, signed for the
                           inbox's address: an inbox needs the secret. At tensor
                           parallel size N: N addresses (a list, or comma-separated),
                           rank r listening on the r-th                           (none)
    kvport_pd_inbox_names  further addresses producers dial this inbox by (its
                           public HOST:PORT when it binds 0.0.0.0)                   ([])
    kvport_pd_destinations a producer streams only to these decode inboxes (the
                           proxy's --decode-inbox list); a request naming another is
                           saved to the store instead                                 ([])
    kvport_pd_inbox_tokens tokens the decode engine's inbox holds (preallocated); a
                           transfer that does not fit is refused and the producer
                           saves to the store instead                              (8192)
    kvport_pd_stream       a producer streams a request's prompt to the inbox its
                           kv_transfer_params name (``kvport_dest``, set by the
                           proxy), instead of saving it for the decode engine        (true)
    kvport_idle_spin_ms    cap vLLM's one-second busy-poll of its engine-core <-> worker
                           queue after each message (kvport.engines.vllm.spin): set
                           it when engines share a host's cores                       (vLLM's)
    kvport_staging_tokens  tokens the load staging and the save buffer each hold,
                           preallocated and touched at start-up (no page faults on the
                           TTFT path); a larger step goes in waves                     (2048)
    kvport_model_revision  a string naming the weights (a git sha, a build id); part
                           of the spec fingerprint, so it changes every key            ("")
    kvport_expect_spec     a KVSpec as a dict: the engine refuses to start when its
                           own spec differs (the error names the first field)          (none)
    kvport_tenant_salt     bytes as hex, chained into every key                        ("")
    kvport_profile         a `kvport calibrate` profile: the cost planner is asked for
                           every lookup and may answer recompute (the hit is declined) (none)
    kvport_eviction        the eviction policy of the engine's own tiers (host, disk):
                           a name of kvport.store.eviction.POLICIES                 (the default)
    kvport_load_deadline   "MIN_S:FACTOR:MAX_S": a step's loads may take FACTOR x the
                           time the worker's observed read speed predicts, within
                           [MIN_S, MAX_S]; blocks not read by then are recomputed      ("1:4:30")

    kvport_config          a kvport config file (TOML, docs/kvport.example.toml): its
                           [tiers.*] and load_deadline give the keys above that are
                           not given here (``KVPORT_*`` variables override the file,
                           the keys given here override both): tiers.host.capacity,
                           tiers.disk.path / capacity, tiers.remote.server / redis /
                           tenant / write, eviction.policy, load_deadline           (none)

Unknown ``kvport_*`` keys are an error (a typo must not silently fall back to a default);
keys without the prefix belong to other connectors and are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvport.configfile import KVPortConfig, join_address, load_config
from kvport.deadline import DeadlinePolicy
from kvport.errors import ConfigError, UnitError
from kvport.spec import KVSpec
from kvport.store.eviction import DEFAULT_POLICY, POLICIES
from kvport.units import parse_size

from .params import parse_dest, parse_dests

_PREFIX = "kvport_"
_KNOWN = frozenset({
    "kvport_disk_dir", "kvport_disk_capacity", "kvport_staging_tokens", "kvport_model_revision",
    "kvport_expect_spec", "kvport_tenant_salt", "kvport_profile", "kvport_load_deadline",
    "kvport_server", "kvport_redis", "kvport_server_tenant", "kvport_host_capacity", "kvport_save_generated",
    "kvport_pd_lease_s",
    "kvport_async_handoff", "kvport_pd_take", "kvport_idle_spin_ms", "kvport_server_write", "kvport_pd_inbox",
    "kvport_pd_inbox_tokens", "kvport_pd_stream", "kvport_pd_inbox_names", "kvport_pd_destinations",
    "kvport_config", "kvport_eviction",
})
DEFAULT_INBOX_TOKENS = 8192
PD_TAKES = ("sync", "async")
DEFAULT_DISK_CAPACITY = 8 * 1024**3
DEFAULT_STAGING_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    disk_dir: Path | None = None
    disk_capacity_bytes: int = DEFAULT_DISK_CAPACITY
    staging_tokens: int = DEFAULT_STAGING_TOKENS
    model_revision: str = ""
    expect_spec: KVSpec | None = None
    tenant_salt: bytes = b""
    profile_path: Path | None = None  # calibration profile: the planner gates every lookup; None = always load
    load_deadline: DeadlinePolicy = field(default_factory=DeadlinePolicy)
    server: tuple[str, int] | None = None  # the shared tier: a kvport server
    redis_url: str | None = None  # the shared tier: Redis or a Redis Cluster (kvport's options in its query)
    server_tenant: str = "default"
    server_write_behind: bool = True
    host_capacity_bytes: int = 0
    save_generated: bool = True
    pd_lease_s: float = 30.0
    async_handoff: bool = True
    pd_take: str = "sync"  # a streamed hand-off: taken in the request's first step ("sync") or in the background
    idle_spin_s: float | None = None  # None: vLLM's own busy-poll window (1 s)
    # decode engine: where streamed hand-offs arrive (HOST:PORT, shm:NAME or nixl:HOST:PORT; one per rank)
    pd_inbox: str | None = None
    pd_inbox_tokens: int = DEFAULT_INBOX_TOKENS
    pd_stream: bool = True
    pd_inbox_names: tuple[str, ...] = ()  # decode engine: other addresses its inbox is dialled by
    pd_destinations: frozenset[str] = frozenset()  # producer: the decode inboxes it may stream to
    eviction: str = DEFAULT_POLICY  # the engine's own tiers (kvport.store.eviction)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        cfg = dict(extra or {})
        path = cfg.pop("kvport_config", None)
        if path is not None:
            if not isinstance(path, str | Path) or not str(path):
                raise ConfigError(f"kvport_config must be the path of a kvport config file, got {path!r}")
            cfg = {**file_keys(load_config(Path(path).expanduser(), role="engine")), **cfg}  # keys given here win
        unknown = sorted(k for k in cfg if k.startswith(_PREFIX) and k not in _KNOWN)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}: expected {sorted(_KNOWN)}")
        disk_dir = cfg.get("kvport_disk_dir")
        if disk_dir is not None and (not isinstance(disk_dir, str | Path) or not str(disk_dir)):
            raise ConfigError(f"kvport_disk_dir must be a folder, got {disk_dir!r}")
        server = _server(cfg.get("kvport_server"))
        redis_url = cfg.get("kvport_redis")
        if redis_url is not None:
            if not isinstance(redis_url, str):
                raise ConfigError(f"kvport_redis must be a Redis URL, got {redis_url!r}")
            from kvport.tiers.redis_tier import split_url

            split_url(redis_url)  # a malformed URL or option fails at start-up, with its name
        if disk_dir is None and server is None and redis_url is None:
            raise ConfigError("kv_connector_extra_config needs kvport_disk_dir (a folder shared by the engines), "
                              "kvport_redis (a Redis URL) or kvport_server (HOST:PORT of a kvport serve)")
        try:
            capacity = parse_size(cfg.get("kvport_disk_capacity", DEFAULT_DISK_CAPACITY))
            host_text = cfg.get("kvport_host_capacity", 0)
            host = 0 if host_text in (0, "0") else parse_size(host_text)
        except UnitError as exc:
            raise ConfigError(f"kvport_disk_capacity / kvport_host_capacity: {exc}") from exc
        write = cfg.get("kvport_server_write", "behind")
        if write not in ("behind", "through"):
            raise ConfigError(f"kvport_server_write must be 'behind' or 'through', got {write!r}")
        tenant = cfg.get("kvport_server_tenant", "default")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"kvport_server_tenant must be a non-empty string, got {tenant!r}")
        save_generated = cfg.get("kvport_save_generated", True)
        if not isinstance(save_generated, bool):
            raise ConfigError(f"kvport_save_generated must be true or false, got {save_generated!r}")
        async_handoff = cfg.get("kvport_async_handoff", True)
        if not isinstance(async_handoff, bool):
            raise ConfigError(f"kvport_async_handoff must be true or false, got {async_handoff!r}")
        take = cfg.get("kvport_pd_take", "sync")
        if take not in PD_TAKES:
            raise ConfigError(f"kvport_pd_take must be one of {', '.join(PD_TAKES)}, got {take!r}")
        lease = cfg.get("kvport_pd_lease_s", 30.0)
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not 0 < lease <= 3600:
            raise ConfigError(f"kvport_pd_lease_s must be seconds in (0, 3600], got {lease!r}")
        spin = cfg.get("kvport_idle_spin_ms")
        if spin is not None and (isinstance(spin, bool) or not isinstance(spin, int | float) or not 0 <= spin <= 1000):
            raise ConfigError(f"kvport_idle_spin_ms must be milliseconds in [0, 1000], got {spin!r}")
        inbox = cfg.get("kvport_pd_inbox")
        if isinstance(inbox, list | tuple) and all(isinstance(a, str) for a in inbox):
            inbox = ",".join(inbox)  # one per tensor-parallel rank
        if inbox is not None and parse_dests(inbox) is None:
            raise ConfigError(f"kvport_pd_inbox must be HOST:PORT, shm:NAME or nixl:HOST:PORT (a list of them, "
                              f"one per tensor parallel rank), got {inbox!r}")
        inbox_tokens = cfg.get("kvport_pd_inbox_tokens", DEFAULT_INBOX_TOKENS)
        if not isinstance(inbox_tokens, int) or isinstance(inbox_tokens, bool) or not 0 < inbox_tokens <= 1 << 24:
            raise ConfigError(f"kvport_pd_inbox_tokens must be a positive integer, got {inbox_tokens!r}")
        if inbox is not None and not async_handoff:
            raise ConfigError("kvport_pd_inbox needs kvport_async_handoff: a streamed hand-off is taken from the inbox "
                              "by the background loader")
        names = _addresses(cfg, "kvport_pd_inbox_names")
        destinations = _addresses(cfg, "kvport_pd_destinations")
        stream = cfg.get("kvport_pd_stream", True)
        if not isinstance(stream, bool):
            raise ConfigError(f"kvport_pd_stream must be true or false, got {stream!r}")
        staging = cfg.get("kvport_staging_tokens", DEFAULT_STAGING_TOKENS)
        if not isinstance(staging, int) or isinstance(staging, bool) or staging <= 0:
            raise ConfigError(f"kvport_staging_tokens must be a positive integer, got {staging!r}")
        revision = cfg.get("kvport_model_revision", "")
        if not isinstance(revision, str):
            raise ConfigError(f"kvport_model_revision must be a string, got {revision!r}")
        expect = cfg.get("kvport_expect_spec")
        if expect is not None and not isinstance(expect, dict):
            raise ConfigError(f"kvport_expect_spec must be a KVSpec dict, got {type(expect).__name__}")
        salt_hex = cfg.get("kvport_tenant_salt", "")
        try:
            salt = bytes.fromhex(salt_hex) if isinstance(salt_hex, str) else None
        except ValueError:
            salt = None
        if salt is None:
            raise ConfigError(f"kvport_tenant_salt must be a hex string, got {salt_hex!r}")
        profile = cfg.get("kvport_profile")
        if profile is not None and (not isinstance(profile, str | Path) or not str(profile)):
            raise ConfigError(f"kvport_profile must be a path to a calibration profile, got {profile!r}")
        eviction = cfg.get("kvport_eviction", DEFAULT_POLICY)
        if eviction not in POLICIES:
            raise ConfigError(f"kvport_eviction must be one of {', '.join(POLICIES)}, got {eviction!r}")
        deadline = cfg.get("kvport_load_deadline", "1:4:30")
        try:
            load_deadline = DeadlinePolicy.parse(deadline)
        except ConfigError as exc:
            raise ConfigError(f"kvport_load_deadline must be MIN_S:FACTOR:MAX_S, got {deadline!r}: {exc}") from None
        return cls(
            load_deadline=load_deadline, eviction=eviction,
            profile_path=None if profile is None else Path(profile).expanduser(),
            disk_dir=None if disk_dir is None else Path(disk_dir).expanduser(),
            server=server, redis_url=redis_url, server_tenant=tenant, server_write_behind=write == "behind",
            host_capacity_bytes=host, save_generated=save_generated,
            pd_lease_s=float(lease), async_handoff=async_handoff, pd_take=take,
            idle_spin_s=None if spin is None else spin / 1000.0,
            pd_inbox=inbox, pd_inbox_tokens=inbox_tokens, pd_stream=stream, pd_inbox_names=names,
            pd_destinations=frozenset(destinations),
            disk_capacity_bytes=capacity,
            staging_tokens=staging,
            model_revision=revision,
            expect_spec=None if expect is None else KVSpec.from_dict(expect),
            tenant_salt=salt,
        )


def file_keys(kv: KVPortConfig) -> dict[str, Any]:
    """The ``kvport_*`` keys a config file gives (only those it, or a ``KVPORT_*`` variable, sets)."""
    t, dl = kv.tiers, kv.load_deadline
    server = None if t.remote.server is None else join_address(t.remote.server)
    table: dict[str, tuple[str, Any]] = {
        "tiers.host.capacity": ("kvport_host_capacity", t.host.capacity_bytes),
        "tiers.disk.path": ("kvport_disk_dir", str(t.disk.path)),
        "tiers.disk.capacity": ("kvport_disk_capacity", t.disk.capacity_bytes),
        "tiers.remote.server": ("kvport_server", server),
        "tiers.remote.redis": ("kvport_redis", t.remote.redis),
        "tiers.remote.tenant": ("kvport_server_tenant", t.remote.tenant),
        "tiers.remote.write": ("kvport_server_write", t.remote.write),
        "load_deadline": ("kvport_load_deadline", f"{dl.min_s}:{dl.factor}:{dl.max_s}"),
        "eviction.policy": ("kvport_eviction", kv.eviction),
    }
    return {name: value for key, (name, value) in table.items() if kv.sets(key)}


def _addresses(cfg: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = cfg.get(key, [])
    if isinstance(value, str):  # one address, or several separated by commas
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple) or len(value) > 1024 or any(parse_dest(v) is None for v in value):
        raise ConfigError(f"{key} must be a list of HOST:PORT, shm:NAME or nixl:HOST:PORT addresses, got {value!r}")
    return tuple(value)


def _server(value: Any) -> tuple[str, int] | None:
    if value is None:
        return None
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"kvport_server must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)
