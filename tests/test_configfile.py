"""The config file: lines of keys, each kind of value, KVPORT_* over the file, checks across keys."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvport.configfile import ConfigFileError, KVPortConfig, load_config
from kvport.configfile.lines import key_lines, line_of
from kvport.deadline import DeadlinePolicy

MiB, GiB = 1 << 20, 1 << 30


def write(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / "kvport.toml"
    p.write_text(text)
    os.chmod(p, mode)
    return p


def problems(path: Path, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigFileError) as exc:
        load_config(path, env or {})
    return [str(p) for p in exc.value.problems]


def test_key_lines_follow_tables_dotted_keys_arrays_and_skip_multiline_strings() -> None:
    text = ('top = 1\n'
            '[server]\n'
            'tls.cert = "a"\n'
            'note = """\n'
            'capacity = 3\n'
            '"""\n'
            '[[tenants]]\n'
            'name = "a"\n'
            '[[tenants]]\n'
            '"name" = "b"\n'
            'inline = {x = 1}\n')
    lines = key_lines(text)
    assert lines[("top",)] == 1 and lines[("server",)] == 2
    assert lines[("server", "tls", "cert")] == 3 and lines[("server", "tls")] == 3
    assert ("server", "capacity") not in lines  # inside a multi-line string
    assert lines[("tenants", 0)] == 7 and lines[("tenants", 0, "name")] == 8
    assert lines[("tenants", 1)] == 9 and lines[("tenants", 1, "name")] == 10
    assert line_of(lines, ("tenants", 1, "inline", "x")) == 11  # inside an inline table: its key's line
    assert line_of(lines, ("nowhere",)) is None


def test_a_full_file_becomes_typed_values_and_says_which_keys_it_set(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    kv = load_config(write(tmp_path, f'''
load_deadline = "2:3:20"
[server]
listen = "[::1]:0"
capacity = "256MiB"
disk = "{tmp_path / 'disk'}"
disk_capacity = "64MiB"
[limits]
max_value = "8MiB"
inflight = "16 MiB"
per_peer_exempt = "10.0.0.0/8, ::1/128"
[eviction]
policy = "slru"
[lifetimes]
session_ttl_s = 30
[tiers.disk]
path = "/tmp/kv"
capacity = "1GB"
[tiers.remote]
server = "kv-0:7878"
write = "through"
[[tenants]]
name = "a"
quota = "1GiB"
token_env = "A_TOKEN"
'''), {"A_TOKEN": "a" * 8})
    assert isinstance(kv, KVPortConfig)
    assert kv.server.listen == ("::1", 0) and kv.server.capacity_bytes == 256 * MiB
    assert kv.server.disk_dir == tmp_path / "disk" and kv.server.disk_capacity_bytes == 64 * MiB
    assert kv.limits.max_value_bytes == 8 * MiB and kv.limits.inflight_bytes == 16 * MiB
    assert kv.limits.per_peer_exempt == ("10.0.0.0/8", "::1/128") and kv.limits.max_connections == 1024
    assert kv.eviction == "slru" and kv.lifetimes.session_ttl_s == 30.0 and kv.lifetimes.request_ttl_s == 60.0
    assert kv.tiers.disk.capacity_bytes == 10**9 and kv.tiers.remote.server == ("kv-0", 7878)
    assert kv.load_deadline == DeadlinePolicy(2.0, 3.0, 20.0)
    assert kv.tenants is not None and [(t.name, t.token, t.quota_bytes) for t in kv.tenants] == [("a", "aaaaaaaa", GiB)]
    assert kv.server.auth_token is None  # with [[tenants]], each tenant has its own
    assert kv.sets("server.capacity") and kv.sets("tenants") and not kv.sets("server.page_size")


def test_variables_override_the_file_and_their_errors_name_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\ncapacity = "256MiB"\n[limits]\nmax_value = "8MiB"\ninflight = "16MiB"\n')
    kv = load_config(path, {"KVPORT_SERVER_CAPACITY": "512MiB", "KVPORT_EVICTION_POLICY": "lfu",
                            "KVPORT_LOAD_DEADLINE": "1:2:3", "KVPORT_AUTH_TOKEN": "from-the-env"})
    assert kv.server.capacity_bytes == 512 * MiB and kv.limits.max_value_bytes == 8 * MiB
    assert kv.eviction == "lfu" and kv.load_deadline == DeadlinePolicy(1.0, 2.0, 3.0)
    assert kv.server.auth_token == "from-the-env" and kv.sets("eviction.policy")
    got = problems(path, {"KVPORT_SERVER_CAPACITY": "lots", "KVPORT_LIMITS_MAX_PENDING": "0"})
    assert got == [
        "environment: KVPORT_SERVER_CAPACITY (server.capacity): cannot parse size 'lots': expected a number and a "
        "unit (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)",
        "environment: KVPORT_LIMITS_MAX_PENDING (limits.max_pending): must be >= 1, got 0",
    ]


def test_every_problem_of_a_file_is_reported_with_its_line_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, '''[server]
listen = "0.0.0.0:7878"
capacity = "8 gigs"
page_size = 4096.5
[server.tls]
key = "{key}"
[limits]
max_value = "-1GiB"
max_connections = 0
[tiers.host]
capcity = "1GiB"
codec = "zstd"
[links.handoff]
codec = "lossless"
[eviction]
policy = "lruu"
[[tenants]]
name = "a"
[[tenants]]
name = "a"
'''.replace("{key}", str(write_key(tmp_path))))
    f = str(path)
    got = problems(path)
    assert got == [
        f"{f}:3: server.capacity: unknown size unit 'gigs' in '8 gigs': expected one of B, kB, MB, GB, TB, KiB, "
        "MiB, GiB, TiB",
        f"{f}:4: server.page_size: expected a size such as \"8GiB\" or an integer of bytes, got 4096.5",
        f"{f}:6: server.tls.key: given without server.tls.cert: a TLS listener needs both",
        f"{f}:8: limits.max_value: size must be positive, got '-1GiB'",
        f"{f}:9: limits.max_connections: must be >= 1, got 0",
        f"{f}:11: tiers.host.capcity: unknown key (did you mean 'capacity'?)",
        f"{f}:12: tiers.host.codec: 'zstd' is not one of int8, kivi4, lossless, mixed, raw",
        f"{f}:14: links.handoff.codec: 'lossless' is not one of int8, kivi4, mixed, raw (lossless has no fixed "
        "encoded size: a link cannot frame it)",
        f"{f}:16: eviction.policy: 'lruu' is not one of " + ", ".join(sorted(_policies())) + " (did you mean 'lru'?)",
        f"{f}:18: tenants[0].name: tenant 'a' has no token: listening on '0.0.0.0' (beyond loopback) needs one "
        "for every tenant",
        f"{f}:20: tenants[1].name: tenant 'a' is listed twice (first: tenants[0])",
    ]
    path = write(tmp_path, '[server]\nlisten = "0.0.0.0:7878"\n')
    assert problems(path) == [f"{path}:2: server.listen: listening on '0.0.0.0' (beyond loopback) needs a token: "
                              "set server.auth_token_env (or KVPORT_AUTH_TOKEN), or give every [[tenants]] a token"]


def write_key(tmp_path: Path) -> Path:
    key = tmp_path / "tls.key"
    key.write_text("not really a key")
    return key


def _policies() -> list[str]:
    from kvport.store.eviction import POLICIES

    return list(POLICIES)


def test_sizes_without_units_and_capacities_this_machine_cannot_hold(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    path = write(tmp_path, f'''[server]
capacity = "4096TiB"
disk = "{tmp_path / 'd' / 'new'}"
disk_capacity = "100000TiB"
[tiers.host]
capacity = 8
[limits]
max_value = "64MiB"
inflight = "32MiB"
''')
    got = "\n".join(problems(path))
    assert ":2: server.capacity: 4503599627370496 bytes is more than this machine's memory" in got
    assert ":4: server.disk_capacity: 109951162777600000 bytes is more than the whole filesystem of" in got
    assert ":6: tiers.host.capacity: 8 is 8 B: at least 1.00 MiB expected (a unit missing?" in got
    assert ":8: limits.inflight: must hold a staging buffer for the largest value: 67108864 bytes" not in got
    assert ":9: limits.inflight: must hold a staging buffer for the largest value: 67108864 bytes or more" in got


def test_tokens_inline_or_by_variable_and_a_warning_for_a_file_every_user_reads(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nlisten = "0.0.0.0:0"\nauth_token = "0123456789abcdef"\n', mode=0o644)
    kv = load_config(path, {})
    assert kv.server.auth_token == "0123456789abcdef"
    (w,) = kv.warnings
    assert w.line == 3 and w.key == "server.auth_token" and "readable by every user" in str(w)
    os.chmod(path, 0o600)
    assert load_config(path, {}).warnings == ()
    path = write(tmp_path, '[server]\nauth_token_env = "NOPE"\nauth_token = "short"\n'
                           '[[tenants]]\nname = "a"\ntoken_env = "UNSET_VAR"\n')
    got = problems(path)
    assert got == [f"{path}:2: server.auth_token_env: give auth_token or auth_token_env, not both",
                   f"{path}:3: server.auth_token: applies only to the default tenant, without [[tenants]]: give "
                   "each tenant its token",
                   f"{path}:6: tenants[0].token_env: the variable UNSET_VAR is not set (or empty)"]
    # an engine reads the same file without the server's tokens (nor its TLS files, RAM or disk)
    path = write(tmp_path, '[server]\nlisten = "0.0.0.0:7878"\ncapacity = "4096TiB"\n[server.tls]\n'
                           'cert = "/nowhere/c.pem"\nkey = "/nowhere/k.pem"\n[[tenants]]\nname = "a"\n'
                           'token_env = "UNSET_VAR"\n')
    kv = load_config(path, {}, role="engine")
    assert kv.tenants is not None and kv.tenants[0].token is None
    assert [p.split(": ")[1] for p in problems(path)] == [
        "server.capacity", "server.tls.cert", "server.tls.key", "tenants[0].token_env"]
    path = write(tmp_path, '[server]\nauth_token = "0123456789"\n[[tenants]]\nname = "a"\n')
    assert problems(path) == [f"{path}:2: server.auth_token: applies only to the default tenant, without "
                              "[[tenants]]: give each tenant its token"]


def test_not_toml_is_one_problem_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\ncapacity = 8GiB\n')
    (p,) = problems(path)
    assert p.startswith(f"{path}:2: (syntax): not valid TOML")


def test_no_file_gives_the_defaults() -> None:
    kv = load_config(None, {})
    assert kv == KVPortConfig(given=frozenset())


def test_hostile_files_are_problems_not_crashes_and_secrets_are_never_echoed(tmp_path: Path) -> None:
    deep = write(tmp_path, "x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert any("nested too deeply" in p or "not valid TOML" in p for p in problems(deep))
    with pytest.raises(ConfigFileError, match="larger than"):
        load_config("/dev/zero", env={})
    odd = write(tmp_path, '[server]\nlisten = "127.0.0.1:\u00b2"\nauth_token_env = "s3cr3t-t0ken-value!"\n'
                          '[tiers.host]\ncapacity = false\n[tiers.remote]\nredis = "http://u:pw@h"\n')
    found = problems(odd, env={"KVPORT_SERVER_CAPACITY": "\u00b2"})
    text = "\n".join(found)
    assert "server.listen" in text and "tiers.host.capacity" in text and "KVPORT_SERVER_CAPACITY" in text
    assert "s3cr3t" not in text and "pw@" not in text  # a token pasted in the wrong key is not printed back
