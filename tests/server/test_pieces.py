"""Tenant salting, the tenants file and secret, the staging pool, limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvport.errors import ConfigError
from kvport.server.limits import ServerLimits
from kvport.server.staging import StagingPool, size_class
from kvport.server.tenants import Tenant, TenantTable, load_or_create_secret, load_tenants

MiB = 1 << 20


def table() -> TenantTable:
    return TenantTable([Tenant("a", b"token-of-a"), Tenant("b", b"token-of-b"), Tenant("open")], b"s" * 32)


def test_same_client_key_is_two_storage_keys_for_two_tenants() -> None:
    t = table()
    key = bytes(16)
    assert t.storage_key("a", key) != t.storage_key("b", key)
    assert t.storage_key("a", key) == table().storage_key("a", key)  # stable for a given secret
    other = TenantTable([Tenant("a")], b"x" * 32)
    assert other.storage_key("a", key) != t.storage_key("a", key)


def test_tenants_file_and_secret(tmp_path: Path) -> None:
    f = tmp_path / "t.json"
    f.write_text('{"tenants": [{"name": "a", "token": "12345678", "quota": "2MiB", "admin": true}]}')
    (a,) = load_tenants(f)
    assert a.quota_bytes == 2 * MiB and a.admin and a.token == b"12345678"
    f.write_text('{"tenants": [{"name": "a", "token": "short"}]}')
    with pytest.raises(ConfigError):
        load_tenants(f)
    s1 = load_or_create_secret(tmp_path)
    assert load_or_create_secret(tmp_path) == s1 and (tmp_path / "server.secret").stat().st_mode & 0o077 == 0


def test_staging_pool_reuses_and_never_exceeds_its_limit() -> None:
    pool = StagingPool(8 * MiB)
    assert size_class(1) == MiB and size_class(3 * MiB) == 4 * MiB
    a = pool.try_take(3 * MiB)
    b = pool.try_take(4 * MiB)
    assert a is not None and b is not None and pool.try_take(MiB) is None
    buf = a.buf
    pool.give(a)
    c = pool.try_take(4 * MiB - 1)
    assert c is not None and c.buf is buf and c.view().nbytes == 4 * MiB - 1
    pool.give(b)
    pool.give(c)
    d = pool.try_take(8 * MiB)  # frees the two 4 MiB buffers first
    assert d is not None and pool.allocated == 8 * MiB == pool.peak_allocated


@pytest.mark.parametrize("field", ["idle_timeout_s", "frame_timeout_s", "lease_ttl_s", "pin_ttl_s"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_limits_refuse_nan_infinite_and_non_positive_times(field: str, bad: float) -> None:
    with pytest.raises(ConfigError, match=field):
        ServerLimits(**{field: bad})  # type: ignore[arg-type]


def test_a_max_value_whose_staging_class_exceeds_the_inflight_budget_is_refused_at_start() -> None:
    from kvport.server.app import ServerConfig

    ServerConfig(limits=ServerLimits(max_value_bytes=32 * MiB, total_inflight_bytes=32 * MiB))
    with pytest.raises(ConfigError, match="at least 67108864"):  # 48 MiB -> a 64 MiB staging buffer
        ServerConfig(limits=ServerLimits(max_value_bytes=48 * MiB, total_inflight_bytes=48 * MiB))


def test_server_config_refuses_what_the_cli_could_pass_through() -> None:
    from kvport.server.app import ServerConfig

    with pytest.raises(ConfigError, match="--disk-capacity"):
        ServerConfig(disk_capacity_bytes=4096, page_bytes=MiB)
    with pytest.raises(ConfigError, match="--http-port"):
        ServerConfig(http_port=70000)
    with pytest.raises(ConfigError, match="KVPORT_AUTH_TOKEN"):  # a default-tenant token beyond loopback: 8+ chars
        ServerConfig(host="0.0.0.0", auth_token="x")
    ServerConfig(host="0.0.0.0", auth_token="12345678")
    ServerConfig(host="127.0.0.1", auth_token="x")  # loopback: any token (or none)
