"""The connectors' ``kvport_config``: the file gives the keys the extra config leaves out."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvport.deadline import DeadlinePolicy
from kvport.engines.vllm.config import ConnectorConfig
from kvport.errors import ConfigError

GiB = 1 << 30


def test_the_file_gives_the_tiers_and_keys_given_here_override_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kvport.toml"
    path.write_text(f'''load_deadline = "2:3:20"
[eviction]
policy = "lfu"
[tiers.host]
capacity = "1GiB"
[tiers.disk]
path = "{tmp_path / 'disk'}"
capacity = "4GiB"
[tiers.remote]
server = "kv-0:7878"
tenant = "chat"
write = "through"
''')
    monkeypatch.delenv("KVPORT_LOAD_DEADLINE", raising=False)
    monkeypatch.setenv("KVPORT_TIERS_REMOTE_TENANT", "agents")  # a variable over the file
    cfg = ConnectorConfig.from_extra_config({"kvport_config": str(path), "kvport_disk_capacity": "2 GiB",
                                             "other_connector_key": 1})
    assert cfg.disk_dir == tmp_path / "disk" and cfg.disk_capacity_bytes == 2 * GiB  # the key given here wins
    assert cfg.host_capacity_bytes == GiB and cfg.server == ("kv-0", 7878) and not cfg.server_write_behind
    assert cfg.server_tenant == "agents" and cfg.load_deadline == DeadlinePolicy(2.0, 3.0, 20.0)
    assert cfg.redis_url is None and cfg.staging_tokens == ConnectorConfig().staging_tokens
    assert cfg.eviction == "lfu"  # the engine's own tiers evict by the file's policy
    assert ConnectorConfig.from_extra_config({"kvport_config": str(path), "kvport_eviction": "lru"}).eviction == "lru"
    with pytest.raises(ConfigError, match="kvport_eviction must be one of"):
        ConnectorConfig.from_extra_config({"kvport_disk_dir": str(tmp_path), "kvport_eviction": "fifo"})


def test_a_bad_file_fails_the_connector_with_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "kvport.toml"
    path.write_text('[tiers.disk]\npath = "/tmp/x"\ncapacity = "4 GiBs"\n[tiers.remote]\nwrite = "later"\n')
    with pytest.raises(ConfigError) as exc:
        ConnectorConfig.from_extra_config({"kvport_config": str(path)})
    assert f"{path}:3: tiers.disk.capacity: unknown size unit 'gibs'" in str(exc.value)
    assert f"{path}:5: tiers.remote.write: 'later' is not one of behind, through" in str(exc.value)
    with pytest.raises(ConfigError, match="kvport_config must be the path"):
        ConnectorConfig.from_extra_config({"kvport_config": 3, "kvport_disk_dir": str(tmp_path)})
