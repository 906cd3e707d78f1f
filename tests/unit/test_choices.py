# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A bad value of an option with fixed choices names every valid one, from each config source
(flag, environment, TOML, a tier's key), and kvstoredctl does the same for its commands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstored.config import ConfigError, load_config
from tests.support.daemon import clean_env


@pytest.mark.parametrize(
    "flags, env, toml, expected",
    [
        ({"write_policy": "write_back"}, {}, None, "'write_back' is not one of write-back, write-through"),
        ({}, {"KVSTORED_EVENTS_ENCODING": "json"}, None, "'json' is not one of map, array"),
        ({}, {}, 'write_policy = "through"\n', "'through' is not one of write-back, write-through"),
        (
            {"tiers": ["kind=fs,root=/tmp/kv-choices,bytes=1GiB,admission=sometimes"]},
            {},
            None,
            "'sometimes' is not one of always, second-eviction",
        ),
        ({"log_level": "loud"}, {}, None, "'loud' is not one of debug, info, warning, error"),
    ],
)
def test_bad_choice_lists_the_valid_ones(tmp_path, flags, env, toml, expected):
    config_file = None
    if toml is not None:
        config_file = tmp_path / "kvstored.toml"
        config_file.write_text(toml)
    with pytest.raises(ConfigError) as exc:
        load_config(flags, env=env, config_file=config_file)
    assert expected in str(exc.value)


def test_the_daemon_says_it_and_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "kvstored", "serve", "--write-policy", "lazy"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "kvstored: flag --write-policy: bad value for write_policy: 'lazy' is not one of write-back, write-through"
    )


def test_kvstoredctl_lists_its_commands():
    proc = subprocess.run(
        [sys.executable, "-m", "kvstored.ctl", "statu"], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert proc.returncode == 2
    assert "invalid choice: 'statu' (choose from 'status', 'stats', 'health'" in proc.stderr and "'top'" in proc.stderr
