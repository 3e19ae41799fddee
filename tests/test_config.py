"""Settings from defaults, TOML, environment and flags; garbage gets a message naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import SETTINGS, Settings, load, markdown_table, parse_hostport, parse_size
from kvtier.errors import ConfigError


@pytest.mark.parametrize("text,value", [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1k", 1000),
                                        ("7", 7), (" 2 kib ", 2048), ("1.5GiB", 3 << 29)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1", "4 parsecs", "1e9", "0x10"])
def test_bad_sizes_name_the_setting(text):
    with pytest.raises(ConfigError, match="host_capacity"):
        load(env={}, overrides={"host_capacity": text})


def test_precedence_defaults_toml_env_flags(tmp_path: Path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('host_capacity = "2GiB"\nnvme_capacity = "3GiB"\nwrite-policy = "write_back"\n'
                   'eviction = "s3fifo"\n')
    s = load(str(cfg), env={"KVTIER_NVME_CAPACITY": "5GiB", "KVTIER_EVICTION": "chain"},
             overrides={"eviction": "lru", "socket": None})
    assert s.host_capacity == 2 << 30            # TOML over default
    assert s.nvme_capacity == 5 << 30            # env over TOML
    assert s.eviction == "lru"                   # flag over env
    assert s.write_policy == "write_back"
    assert s.hbm_capacity == Settings().hbm_capacity


def test_kvtier_table_in_toml_is_accepted(tmp_path: Path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('[kvtier]\nio_threads = 2\n')
    assert load(str(cfg), env={}).io_threads == 2


@pytest.mark.parametrize("body,match", [
    ("host_capacity = [1, 2]", "host_capacity"),
    ("no_such_thing = 1", "unknown setting 'no_such_thing'"),
    ("write_policy = 'sometimes'", "write_policy"),
    ("this is not toml", "not valid TOML"),
    ("io_threads = 'many'", "io_threads"),
    ("io_threads = 0", "io_threads"),
    ("admin = 'nowhere'", "HOST:PORT"),
    ("compact_threshold = 3", "compact_threshold"),
    ("eviction_host = 'random'", "eviction_host"),
    ("allowed_uids = 'a,b'", "allowed_uids"),
])
def test_garbage_in_the_config_file(tmp_path: Path, body, match):
    cfg = tmp_path / "k.toml"
    cfg.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load(str(cfg), env={})


def test_binary_garbage_and_missing_config_file(tmp_path: Path):
    cfg = tmp_path / "k.toml"
    cfg.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(str(cfg), env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load(str(tmp_path / "missing.toml"), env={})


@pytest.mark.parametrize("name", ["lease_timeout", "flush_interval", "compact_threshold",
                                  "redis_timeout", "busy_poll_us"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan")])
def test_a_number_that_is_not_finite_names_the_setting(name, value):
    with pytest.raises(ConfigError, match=f"{name}: expected a finite number"):
        load(env={}, overrides={name: value})


def test_a_socket_path_too_long_for_a_unix_socket_is_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="at most 107"):
        load(env={}, overrides={"socket": str(tmp_path / ("s" * 120))})
    with pytest.raises(ConfigError, match="data_dir"):      # the default socket is inside it
        load(env={}, overrides={"data_dir": "/tmp/" + "d" * 100})
    assert load(env={}, overrides={"socket": "/tmp/" + "s" * 102}).socket


def test_garbage_in_the_environment():
    with pytest.raises(ConfigError, match="reserve_timeout"):
        load(env={"KVTIER_RESERVE_TIMEOUT": "soon"})


def test_hostport():
    assert parse_hostport("127.0.0.1:8787") == ("127.0.0.1", 8787)
    assert parse_hostport("[::1]:80") == ("::1", 80)
    with pytest.raises(ConfigError):
        parse_hostport("host:99999")


def test_markdown_table_lists_every_setting():
    table = markdown_table()
    for s in SETTINGS:
        assert f"`{s.name}`" in table and f"KVTIER_{s.name.upper()}" in table
