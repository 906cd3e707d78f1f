# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Config: precedence flags > env > file > defaults, size parsing, and errors that name the option."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstored.config import Config, ConfigError, env_name, flag_name, load_config, options
from kvstored.sizes import parse_size
from kvstored.tiers.config import FsTierConfig, S3TierConfig


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstored.toml"
    path.write_text(text)
    return path


# -- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        ("0", 0),
        ("1_000_000", 1_000_000),
        ("512B", 512),
        ("1k", 1000),
        ("1KB", 1000),
        ("64KiB", 64 << 10),
        ("64kib", 64 << 10),
        ("2M", 2_000_000),
        ("16MiB", 16 << 20),
        (" 16 MiB ", 16 << 20),
        ("2G", 2_000_000_000),
        ("2GB", 2_000_000_000),
        ("8GiB", 8 << 30),
        ("1.5GiB", 3 << 29),
        ("1TiB", 1 << 40),
        ("3T", 3 * 10**12),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_passes_ints_through():
    assert parse_size(12345) == 12345


@pytest.mark.parametrize("text", ["", "   ", "abc", "MiB", "-1", "1.5.2", "12XB", "1e9", "1 2 MiB", "0x10"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_rejects_negative_int():
    with pytest.raises(ValueError):
        parse_size(-5)


# -- defaults and precedence -----------------------------------------------------------------


def test_defaults(tmp_path):
    cfg = load_config({}, {})
    defaults = Config()
    assert cfg == defaults
    assert cfg.page_bytes == 64 << 10
    assert cfg.populate is True
    assert cfg.max_batch_keys == 8192
    assert cfg.grace_seconds == 5.0
    assert cfg.log_level == "info"
    assert cfg.log_format == "text"
    assert cfg.socket_mode == 0o660
    assert cfg.cpu_bytes > 0
    assert cfg.session_socket == Path(f"{cfg.socket}.session")


def test_socket_default_follows_kvstored_socket_env(monkeypatch):
    monkeypatch.setenv("KVSTORED_SOCKET", "/tmp/kvx/some.sock")
    cfg = load_config({}, None)  # env=None reads os.environ
    assert cfg.socket == Path("/tmp/kvx/some.sock")
    assert cfg.session_socket == Path("/tmp/kvx/some.sock.session")


# (option, file value, env value, flag value, parsed file, parsed env, parsed flag)
PRECEDENCE_CASES = [
    ("cpu_bytes", '"1GiB"', "2GiB", "3GiB", 1 << 30, 2 << 30, 3 << 30),
    ("page_bytes", "8192", "16KiB", "32KiB", 8192, 16 << 10, 32 << 10),
    ("populate", "false", "yes", "off", False, True, False),
    ("max_batch_keys", "10", "20", "30", 10, 20, 30),
    ("grace_seconds", "1.5", "2.5", "0", 1.5, 2.5, 0.0),
    ("log_level", '"debug"', "warning", "error", "debug", "warning", "error"),
    ("log_format", '"json"', "text", "json", "json", "text", "json"),
    ("socket_mode", '"600"', "640", "666", 0o600, 0o640, 0o666),
    (
        "socket",
        '"/tmp/a.sock"',
        "/tmp/b.sock",
        "/tmp/c.sock",
        Path("/tmp/a.sock"),
        Path("/tmp/b.sock"),
        Path("/tmp/c.sock"),
    ),
]


@pytest.mark.parametrize("case", PRECEDENCE_CASES, ids=[c[0] for c in PRECEDENCE_CASES])
def test_precedence_flags_over_env_over_file_over_default(tmp_path, case):
    name, file_v, env_v, flag_v, want_file, want_env, want_flag = case
    toml = write_toml(tmp_path, f"{name} = {file_v}\n")
    env = {env_name(name): env_v}
    flags = {name: flag_v}
    default = getattr(load_config({}, {}), name)
    assert getattr(load_config(flags, env, toml), name) == want_flag
    assert getattr(load_config({}, env, toml), name) == want_env
    assert getattr(load_config({name: None}, {}, toml), name) == want_file  # None = flag not given
    assert getattr(load_config({}, {}, None), name) == default
    # Each source only touches its own option.
    other = load_config(flags, env, toml)
    assert other.max_batch_keys == (want_flag if name == "max_batch_keys" else 8192)


def test_sources_combine_per_option(tmp_path):
    toml = write_toml(tmp_path, 'cpu_bytes = "1GiB"\npage_bytes = "8KiB"\nmax_batch_keys = 7\n')
    env = {"KVSTORED_PAGE_BYTES": "16KiB", "KVSTORED_MAX_BATCH_KEYS": "9"}
    cfg = load_config({"max_batch_keys": "11"}, env, toml)
    assert cfg.cpu_bytes == 1 << 30  # file only
    assert cfg.page_bytes == 16 << 10  # env beats file
    assert cfg.max_batch_keys == 11  # flag beats both


def test_config_file_from_env(tmp_path):
    toml = write_toml(tmp_path, 'cpu_bytes = "3MiB"\n')
    cfg = load_config({}, {"KVSTORED_CONFIG": str(toml)})
    assert cfg.cpu_bytes == 3 << 20


def test_explicit_config_file_beats_env_config(tmp_path):
    a = tmp_path / "a.toml"
    a.write_text('cpu_bytes = "3MiB"\n')
    b = tmp_path / "b.toml"
    b.write_text('cpu_bytes = "5MiB"\n')
    assert load_config({}, {"KVSTORED_CONFIG": str(a)}, b).cpu_bytes == 5 << 20


def test_toml_native_types(tmp_path):
    toml = write_toml(tmp_path, "cpu_bytes = 8388608\npopulate = true\ngrace_seconds = 3\nsocket_mode = 384\n")
    cfg = load_config({}, {}, toml)
    assert cfg.cpu_bytes == 8 << 20
    assert cfg.populate is True
    assert cfg.grace_seconds == 3.0
    assert cfg.socket_mode == 0o600


def test_every_option_has_flag_env_and_help():
    for f in options():
        assert flag_name(f.name) == "--" + f.name.replace("_", "-")
        assert env_name(f.name) == "KVSTORED_" + f.name.upper()
        assert f.metadata["help"]


# -- bad values ---------------------------------------------------------------------------------

BAD_VALUES = [
    ("cpu_bytes", "lots"),
    ("cpu_bytes", "-1GiB"),
    ("cpu_bytes", "0"),  # smaller than one page
    ("cpu_bytes", "1000"),  # smaller than one page
    ("page_bytes", "1000"),  # not a multiple of 4096
    ("page_bytes", "0"),
    ("page_bytes", "4KB"),  # 4000
    ("populate", "maybe"),
    ("max_batch_keys", "many"),
    ("max_batch_keys", "0"),
    ("max_batch_keys", "-3"),
    ("max_batch_keys", "1.5"),
    ("grace_seconds", "soon"),
    ("grace_seconds", "-1"),
    ("grace_seconds", "nan"),
    ("log_level", "loud"),
    ("log_format", "xml"),
    ("socket_mode", "rw-rw----"),
    ("socket_mode", "9"),
    ("socket_mode", "-1"),
    ("socket_mode", "77777"),  # not permission bits: chmod would silently keep 0o7777
    ("socket", "/tmp/" + "x" * 120 + "/kv.sock"),  # longer than a unix socket path can be
    ("events_buffer", "-1"),
    ("events_zmq_endpoint", "127.0.0.1:5557"),  # no transport: zmq's bind fails after the tiers started
    ("events_zmq_endpoint", "tpc://127.0.0.1:5557"),
    ("events_zmq_endpoint", "tcp://"),
]


@pytest.mark.parametrize("name, value", BAD_VALUES, ids=[f"{n}={v[:24]}" for n, v in BAD_VALUES])
def test_bad_flag_value_names_the_option(name, value):
    with pytest.raises(ConfigError) as info:
        load_config({name: value}, {})
    assert name in str(info.value)


BAD_ENV_VALUES = [
    ("cpu_bytes", "lots"),
    ("cpu_bytes", "1000"),
    ("page_bytes", "1000"),
    ("populate", "maybe"),
    ("max_batch_keys", "many"),
    ("grace_seconds", "-1"),
    ("log_level", "loud"),
    ("socket_mode", "9"),
]


@pytest.mark.parametrize("name, value", BAD_ENV_VALUES, ids=[f"{n}={v}" for n, v in BAD_ENV_VALUES])
def test_bad_env_value_names_the_option(name, value):
    with pytest.raises(ConfigError) as info:
        load_config({}, {env_name(name): value})
    assert name in str(info.value)


def test_parse_errors_name_the_source(tmp_path):
    with pytest.raises(ConfigError, match="--cpu-bytes"):
        load_config({"cpu_bytes": "lots"}, {})
    with pytest.raises(ConfigError, match="KVSTORED_CPU_BYTES"):
        load_config({}, {"KVSTORED_CPU_BYTES": "lots"})
    toml = write_toml(tmp_path, 'cpu_bytes = "lots"\n')
    with pytest.raises(ConfigError, match="cpu_bytes") as info:
        load_config({}, {}, toml)
    assert str(toml) in str(info.value)


def test_bad_file_value_names_the_option(tmp_path):
    toml = write_toml(tmp_path, 'populate = "maybe"\n')
    with pytest.raises(ConfigError, match="populate"):
        load_config({}, {}, toml)
    toml = write_toml(tmp_path, "socket = 5\n")
    with pytest.raises(ConfigError, match="socket"):
        load_config({}, {}, toml)


def test_empty_env_value_is_an_error_not_the_default():
    with pytest.raises(ConfigError, match="cpu_bytes"):
        load_config({}, {"KVSTORED_CPU_BYTES": ""})


def test_an_overridden_malformed_value_is_never_parsed(tmp_path):
    # A flag overrides a malformed env value: the env value is never parsed.
    cfg = load_config({"cpu_bytes": "4MiB"}, {"KVSTORED_CPU_BYTES": "lots"})
    assert cfg.cpu_bytes == 4 << 20


def test_unknown_file_option_is_named(tmp_path):
    toml = write_toml(tmp_path, 'cpu_bytes = "4MiB"\ncpu_byte = "8MiB"\n')
    with pytest.raises(ConfigError, match="cpu_byte"):
        load_config({}, {}, toml)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config({}, {}, tmp_path / "nope.toml")


def test_invalid_toml(tmp_path):
    toml = write_toml(tmp_path, "cpu_bytes = = 3\n")
    with pytest.raises(ConfigError, match="TOML"):
        load_config({}, {}, toml)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# -- tiers and events: ranges -------------------------------------------------------------------

# (tier spec, option, bad value as the message shows it)
BAD_TIERS = [
    ("kind=fs,root=/kv,bytes=1GiB,concurrency=0", "concurrency", "0"),  # no worker: loads wait forever
    ("kind=fs,root=/kv,bytes=1GiB,max_backlog=-1", "max_backlog", "-1"),  # every write-down dropped
    ("kind=fs,root=/kv,bytes=1GiB,max_backlog=0", "max_backlog", "0"),
    ("kind=fs,root=/kv,bytes=0", "bytes", "0"),
    ("kind=fs,root=/kv,bytes=1GiB,io_threads=0", "io_threads", "0"),
    ("kind=fs,root=/kv,bytes=1GiB,io_threads=many", "io_threads", "many"),
    ("kind=s3,bucket=kv,concurrency=0", "concurrency", "0"),
    ("kind=s3,bucket=kv,max_backlog=-1", "max_backlog", "-1"),
    ("kind=s3,bucket=kv,timeout_s=0", "timeout_s", "0"),
    ("kind=s3,bucket=kv,timeout_s=inf", "timeout_s", "inf"),
    ("kind=s3,bucket=kv,negative_cache_s=-1", "negative_cache_s", "-1"),
    ("kind=s3,bucket=kv,breaker_failures=0", "breaker_failures", "0"),
    ("kind=s3,bucket=kv,breaker_reset_s=nan", "breaker_reset_s", "nan"),
]


@pytest.mark.parametrize("spec, option, value", BAD_TIERS, ids=[s for s, _, _ in BAD_TIERS])
def test_bad_tier_option_names_option_and_value(spec, option, value):
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [spec]}, {})
    message = str(info.value)
    assert "--tiers" in message and option in message and value in message


def test_tier_ranges_in_toml_at_their_bounds(tmp_path):
    good = write_toml(
        tmp_path,
        """
[[tiers]]
kind = "fs"
root = "/kv"
bytes = 1
io_threads = 1
concurrency = 1
max_backlog = 1

[[tiers]]
kind = "s3"
bucket = "kv"
bytes = 0
negative_cache_s = 0
breaker_failures = 1
breaker_reset_s = 0
""",
    )
    fs, s3 = load_config({}, {}, good).tiers
    assert (fs.bytes, fs.io_threads, fs.concurrency, fs.max_backlog) == (1, 1, 1, 1)
    assert (s3.bytes, s3.negative_cache_s, s3.breaker_reset_s) == (0, 0.0, 0.0)
    bad = write_toml(tmp_path, '[[tiers]]\nkind = "fs"\nroot = "/kv"\nbytes = "1GiB"\nmax_backlog = -1\n')
    with pytest.raises(ConfigError) as info:
        load_config({}, {}, bad)
    assert str(bad) in str(info.value) and "max_backlog" in str(info.value) and "-1" in str(info.value)


def test_validate_range_checks_tiers_built_directly():
    with pytest.raises(ConfigError, match="concurrency must be >= 1, got 0"):
        Config(tiers=(FsTierConfig(Path("/kv"), 1 << 30, concurrency=0),)).validate()
    with pytest.raises(ConfigError, match="max_backlog must be >= 1, got -1"):
        Config(tiers=(S3TierConfig("kv", max_backlog=-1),)).validate()


def test_bad_events_options_name_the_value():
    with pytest.raises(ConfigError, match="events_buffer.*-1"):
        load_config({"events_buffer": "-1"}, {})
    with pytest.raises(ConfigError, match="events_zmq_endpoint.*'127.0.0.1:5557'"):
        load_config({"events_zmq_endpoint": "127.0.0.1:5557"}, {})
    with pytest.raises(ConfigError, match="events_zmq_replay_endpoint.*'localhost:5558'"):
        load_config({"events_zmq_endpoint": "tcp://127.0.0.1:5557", "events_zmq_replay_endpoint": "localhost:5558"}, {})


def test_zmq_replay_needs_the_publisher_and_its_own_endpoint():
    with pytest.raises(ConfigError, match="events_zmq_replay_endpoint needs events_zmq_endpoint"):
        load_config({"events_zmq_replay_endpoint": "tcp://127.0.0.1:5558"}, {})
    with pytest.raises(ConfigError, match="must differ"):
        load_config({"events_zmq_endpoint": "ipc:///run/kv/ev", "events_zmq_replay_endpoint": "ipc:///run/kv/ev"}, {})
    cfg = load_config(
        {
            "events_zmq_endpoint": "ipc:///run/kv/ev",
            "events_zmq_replay_endpoint": "tcp://[::1]:5558",
            "events_buffer": "0",
        },
        {},
    )
    assert (cfg.events_zmq_endpoint, cfg.events_buffer) == ("ipc:///run/kv/ev", 0)


def test_a_system_socket_we_may_not_see_is_not_the_clients_default(monkeypatch):
    """/run/kvstored is 0750: for a user outside its group, stat() fails with EACCES."""
    from kvstored_client import paths

    class Hidden:
        def exists(self):
            raise PermissionError(13, "Permission denied")

    monkeypatch.delenv("KVSTORED_SOCKET", raising=False)
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", Hidden())
    monkeypatch.setattr(paths.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert paths.default_socket_path() == Path("/run/user/1000/kvstored/kvstored.sock")


def test_the_daemons_default_socket_ignores_a_running_system_daemon(monkeypatch, tmp_path):
    from kvstored_client import paths

    system = tmp_path / "kvstored.sock"
    system.touch()
    monkeypatch.delenv("KVSTORED_SOCKET", raising=False)
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", system)
    monkeypatch.setattr(paths.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert paths.default_socket_path() == system  # a client finds the system daemon
    assert paths.default_socket_path(for_daemon=True) == Path("/run/user/1000/kvstored/kvstored.sock")


def test_pool_pages_and_numa_node_from_every_source(tmp_path):
    from kvstored.shm.memory import NumaPlacement, PoolPages

    assert (Config().pool_pages, Config().numa_node) == (PoolPages.SMALL, None)
    assert load_config({"pool_pages": "hugetlb", "numa_node": "1"}, {}).numa_node == NumaPlacement(1)
    cfg = load_config({}, {env_name("pool_pages"): "THP", env_name("numa_node"): "interleave"})
    assert (cfg.pool_pages, cfg.numa_node, str(cfg.numa_node)) == (PoolPages.THP, NumaPlacement(None), "interleave")
    path = tmp_path / "c.toml"
    path.write_text('pool_pages = "4k"\nnuma_node = 0\n')
    assert load_config({}, {}, path).numa_node == NumaPlacement(0)
    with pytest.raises(ConfigError, match="bad value for numa_node: 'gpu0' is not a NUMA node number, interleave"):
        load_config({"numa_node": "gpu0"}, {})
    with pytest.raises(ConfigError, match="bad value for pool_pages: '2m' is not one of 4k, thp, hugetlb"):
        load_config({"pool_pages": "2m"}, {})


# -- tenant quota --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [("50%", 8 << 30), ("0.25", 4 << 30), (0.25, 4 << 30), ("4GiB", 4 << 30), ("100%", 16 << 30), ("64GiB", 16 << 30)],
)
def test_tenant_quota_is_a_fraction_of_the_ram_tier_or_bytes(raw, expected):
    cfg = load_config(flags={"cpu_bytes": "16GiB", "tenant_quota": raw}, env={})
    assert cfg.tenant_quota_bytes == expected  # never more than the RAM tier


def test_tenant_quota_defaults_to_half_the_ram_tier():
    assert load_config(flags={"cpu_bytes": "16GiB"}, env={}).tenant_quota_bytes == 8 << 30


@pytest.mark.parametrize("raw", ["150%", "0%", "1.5", "-1", "lots"])
def test_bad_tenant_quota_names_the_option(raw):
    with pytest.raises(ConfigError, match="tenant_quota"):
        load_config(flags={"tenant_quota": raw}, env={})


def test_a_tenant_quota_below_one_page_is_refused():
    with pytest.raises(ConfigError, match="tenant_quota"):
        load_config(flags={"cpu_bytes": "1GiB", "tenant_quota": "4KiB"}, env={})


def test_staging_bytes_is_off_or_at_least_a_page():
    assert load_config({}, {}).staging_bytes == 64 << 20
    assert load_config({"staging_bytes": "0"}, {}).staging_bytes == 0  # off: region loads promote
    assert load_config({}, {"KVSTORED_STAGING_BYTES": "256MiB"}).staging_bytes == 256 << 20
    with pytest.raises(ConfigError, match="staging_bytes must be 0 .* got 100"):
        load_config({"staging_bytes": "100"}, {})


def test_tiers_without_a_name_are_named_after_their_kind_uniquely():
    """`make run RUN_ARGS="--tiers kind=fs,..."` adds a second fs tier to the default one: it
    needs no name= of its own."""
    cfg = load_config(
        {
            "tiers": [
                "kind=fs,root=/a,bytes=1GiB",
                "kind=fs,root=/b,bytes=1GiB",
                "kind=fs,root=/c,bytes=1GiB,name=fs-3",  # a name given is kept, and skipped below
                "kind=fs,root=/d,bytes=1GiB",
                "kind=s3,bucket=kv",
            ]
        },
        {},
    )
    assert [t.name for t in cfg.tiers] == ["fs", "fs-2", "fs-3", "fs-4", "s3"]
    with pytest.raises(ConfigError, match=r"tier names must be unique, got \['hot', 'hot'\]"):
        load_config({"tiers": ["kind=fs,root=/a,bytes=1GiB,name=hot", "kind=s3,bucket=kv,name=hot"]}, {})


def test_help_lists_the_tier_keys_of_every_kind():
    from kvstored.cli import build_parser
    from kvstored.tiers.registry import KINDS

    text = build_parser().format_help()
    for label, spec in KINDS.items():
        assert f"kind={label}: " in text
        for f in dataclasses.fields(spec.config):
            assert f.name in text.split(f"kind={label}: ", 1)[1], (label, f.name)
    assert "root (required), bytes (required), name=fs," in text
    assert max(len(line) for line in text.split("--tiers keys per kind", 1)[1].splitlines()) <= 80
