"""Every key of the config file: its kind, its ``KVPORT_*`` variable, the typed field it fills."""

from __future__ import annotations

from kvport.codec import codec_ids
from kvport.configfile.fields import (
    ENV_NAME,
    Address,
    Boolean,
    Choice,
    DeadlineText,
    Integer,
    Kind,
    Networks,
    PathText,
    Seconds,
    Size,
    Text,
)
from kvport.store.eviction import POLICIES

MiB = 1 << 20
TENANT_NAME = r"[^/\x00-\x1f\x7f]{1,64}"  # as kvport.server.tenants.Tenant takes it
MiB = 1 << 20
_FIXED_SIZE = "lossless"  # the one codec whose encoded size depends on the data: no link can frame it


def _policies() -> list[str]:
    return sorted(POLICIES)


def _link_codecs() -> list[str]:
    return [c for c in codec_ids() if c != _FIXED_SIZE]


# every key of the file: dotted path -> kind (the variable that overrides it: KVPORT_ + path in capitals)
KEYS: dict[str, Kind] = {
    "server.listen": Address(),
    "server.http_port": Integer(0, 65535),
    "server.capacity": Size(16 * MiB),
    "server.disk": PathText(),
    "server.disk_capacity": Size(MiB),
    "server.page_size": Size(4096),
    "server.io_threads": Integer(0, 64),
    "server.spill_on_shutdown": Boolean(),
    "server.prefault": Boolean(),
    "server.auth_token": Text(secret=True),
    "server.auth_token_env": ENV_NAME,
    "server.tls.cert": PathText(),  # a file: checked where the server runs (ROLES)
    "server.tls.key": PathText(),
    "tiers.host.capacity": Size(MiB, zero=True),
    "tiers.host.codec": Choice(codec_ids),
    "tiers.disk.path": PathText(),
    "tiers.disk.capacity": Size(MiB),
    "tiers.disk.codec": Choice(codec_ids),
    "tiers.remote.server": Address(1),
    "tiers.remote.redis": Text(r"(rediss?|unix)://.+", "a Redis URL (redis://HOST:PORT/DB)", secret=True),
    "tiers.remote.tenant": Text(TENANT_NAME, "a tenant name (1-64 printable characters, no '/')"),
    "tiers.remote.write": Choice(lambda: ("behind", "through")),
    "tiers.remote.codec": Choice(codec_ids),
    "links.handoff.codec": Choice(_link_codecs, " (lossless has no fixed encoded size: a link cannot frame it)"),
    "eviction.policy": Choice(_policies),
    "lifetimes.request_ttl_s": Seconds(),
    "lifetimes.session_ttl_s": Seconds(),
    "limits.max_value": Size(4096),
    "limits.inflight": Size(4096),
    "limits.max_connections": Integer(1),
    "limits.max_pending": Integer(1),
    "limits.max_per_peer": Integer(0),
    "limits.per_peer_exempt": Networks(),
    "limits.idle_timeout_s": Seconds(),
    "limits.frame_timeout_s": Seconds(),
    "limits.write_timeout_s": Seconds(),
    "limits.handshake_timeout_s": Seconds(),
    "load_deadline": DeadlineText(),
}
TENANT_KEYS: dict[str, Kind] = {
    "name": Text(TENANT_NAME, "1-64 printable characters, no '/'"),
    "token": Text(secret=True),
    "token_env": ENV_NAME,
    "quota": Size(MiB),
    "admin": Boolean(),
}
# variables kvport read before the file existed keep their names
ENV_ALIASES = {"server.auth_token": "KVPORT_AUTH_TOKEN", "tiers.remote.redis": "KVPORT_REDIS_URL",
               "load_deadline": "KVPORT_LOAD_DEADLINE"}
NO_ENV = frozenset({"server.auth_token_env"})


def env_name(key: str) -> str:
    return ENV_ALIASES.get(key) or "KVPORT_" + key.upper().replace(".", "_")




# file key -> (its section, the section's field); server.auth_token(_env) and server.tls.* are built apart
FIELDS: dict[str, tuple[str, str]] = {
    "server.listen": ("server", "listen"), "server.http_port": ("server", "http_port"),
    "server.capacity": ("server", "capacity_bytes"), "server.disk": ("server", "disk_dir"),
    "server.disk_capacity": ("server", "disk_capacity_bytes"), "server.page_size": ("server", "page_bytes"),
    "server.io_threads": ("server", "io_threads"), "server.spill_on_shutdown": ("server", "spill_on_shutdown"),
    "server.prefault": ("server", "prefault"),
    "tiers.host.capacity": ("host", "capacity_bytes"), "tiers.host.codec": ("host", "codec"),
    "tiers.disk.path": ("disk", "path"), "tiers.disk.capacity": ("disk", "capacity_bytes"),
    "tiers.disk.codec": ("disk", "codec"),
    "tiers.remote.server": ("remote", "server"), "tiers.remote.redis": ("remote", "redis"),
    "tiers.remote.tenant": ("remote", "tenant"), "tiers.remote.write": ("remote", "write"),
    "tiers.remote.codec": ("remote", "codec"),
    "links.handoff.codec": ("links", "handoff_codec"),
    "lifetimes.request_ttl_s": ("lifetimes", "request_ttl_s"),
    "lifetimes.session_ttl_s": ("lifetimes", "session_ttl_s"),
    "limits.max_value": ("limits", "max_value_bytes"), "limits.inflight": ("limits", "inflight_bytes"),
    "limits.max_connections": ("limits", "max_connections"), "limits.max_pending": ("limits", "max_pending"),
    "limits.max_per_peer": ("limits", "max_per_peer"), "limits.per_peer_exempt": ("limits", "per_peer_exempt"),
    "limits.idle_timeout_s": ("limits", "idle_timeout_s"), "limits.frame_timeout_s": ("limits", "frame_timeout_s"),
    "limits.write_timeout_s": ("limits", "write_timeout_s"),
    "limits.handshake_timeout_s": ("limits", "handshake_timeout_s"),
}


