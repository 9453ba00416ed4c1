"""Tenants: who a request belongs to, how its keys are salted, and its quota.

Key salting happens on the server, never on the client::

    tenant_salt  = HMAC-SHA256(server_secret, "kvport.tenant.v1" | tenant name)
    storage_key  = BLAKE2b-128(client block key, key=tenant_salt)

``server_secret`` is 32 random bytes created once in the disk folder (mode 0600), so a restart maps
the same (tenant, key) to the same storage key and finds its disk blocks again. Consequences:

- Two tenants sending the same client key address two different storage keys: a tenant probing
  another tenant's prefix always gets a miss, through the same dict lookup as any other miss, so
  the answer's timing does not depend on what other tenants hold (no cross-tenant dedup either).
- A tenant cannot compute another tenant's storage keys without the server secret.

Tenants file (JSON)::

    {"tenants": [{"name": "a", "token": "secret-a", "quota": "2GiB", "admin": false}, ...]}

A tenant with a ``token`` must prove it (see :mod:`kvport.server.auth`) on every connection; a
server listening beyond loopback refuses to start while any tenant lacks a token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvport.config import MIN_TOKEN_CHARS
from kvport.errors import ConfigError, UnitError
from kvport.units import parse_size

SECRET_FILE = "server.secret"
_SECRET_BYTES = 32
_MAX_NAME = 64
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    token: bytes | None = field(default=None, repr=False)
    quota_bytes: int | None = None  # None: bounded only by the server's capacity
    admin: bool = False  # may inspect every tenant (others see only themselves)

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > _MAX_NAME or not self.name.isprintable():
            raise ConfigError(f"tenant name must be 1-{_MAX_NAME} printable characters, got {self.name!r}")
        if "/" in self.name:  # holders are "tenant/instance": "a" with instance "b/c" must never be "a/b"'s "c"
            raise ConfigError(f"tenant name must not contain '/', got {self.name!r}")
        if self.quota_bytes is not None and self.quota_bytes <= 0:
            raise ConfigError(f"tenant {self.name!r}: quota must be positive")


class TenantTable:
    """The tenants a server accepts, with their salts (derived from the server secret)."""

    def __init__(self, tenants: Iterable[Tenant], secret: bytes) -> None:
        if len(secret) < 16:
            raise ConfigError("server secret must be at least 16 bytes")
        self._tenants: dict[str, Tenant] = {}
        for t in tenants:
            if t.name in self._tenants:
                raise ConfigError(f"tenant {t.name!r} listed twice")
            self._tenants[t.name] = t
        if not self._tenants:
            raise ConfigError("at least one tenant is required")
        self._salts = {
            name: hmac.new(secret, b"kvport.tenant.v1" + name.encode(), hashlib.sha256).digest()
            for name in self._tenants
        }

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def names(self) -> list[str]:
        return sorted(self._tenants)

    def key_lookup(self, name: str) -> tuple[bool, bytes | None]:
        """(known, token) of a tenant, as the handshake asks for it."""
        t = self._tenants.get(name)
        return (t is not None, None if t is None else t.token)

    def quotas(self) -> dict[str, int]:
        return {n: t.quota_bytes for n, t in self._tenants.items() if t.quota_bytes is not None}

    def all_have_tokens(self) -> bool:
        return all(t.token for t in self._tenants.values())

    def storage_key(self, tenant: str, key: bytes) -> bytes:
        """The server-side name of a tenant's block; ``tenant`` must be known."""
        return hashlib.blake2b(key, key=self._salts[tenant], digest_size=16).digest()


def load_or_create_secret(folder: Path) -> bytes:
    """The server secret kept in ``folder`` (created with mode 0600 on first start)."""
    path = folder / SECRET_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = _create_secret(folder, path)
    except OSError as exc:
        raise ConfigError(f"cannot read server secret {path}: {exc}") from exc
    if len(data) != _SECRET_BYTES:
        raise ConfigError(f"server secret {path} is {len(data)} bytes, expected {_SECRET_BYTES}")
    return data


def _create_secret(folder: Path, path: Path) -> bytes:
    data = secrets.token_bytes(_SECRET_BYTES)
    tmp = path.with_suffix(".tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot create server secret {path}: {exc}") from exc
    return data


def load_tenants(path: Path | None, default_token: str | None = None) -> list[Tenant]:
    """Tenants from a JSON file; without a file, one admin tenant ``default`` (token optional)."""
    if path is None:
        return [Tenant(DEFAULT_TENANT, default_token.encode() if default_token else None, None, True)]
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc}") from exc
    items = doc.get("tenants") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise ConfigError(f"tenants file {path}: expected {{\"tenants\": [...]}}")
    out: list[Tenant] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(f"tenants file {path}: every tenant needs a string 'name'")
        token = item.get("token")
        if token is not None and (not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS):
            raise ConfigError(f"tenant {item['name']!r}: token must be a string of at least 8 characters")
        quota = item.get("quota")
        try:
            quota_bytes = None if quota is None else parse_size(quota)
        except UnitError as exc:
            raise ConfigError(f"tenant {item['name']!r}: {exc}") from exc
        out.append(Tenant(item["name"], token.encode() if token else None, quota_bytes, bool(item.get("admin"))))
    return out
