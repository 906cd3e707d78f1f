# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer tier's configuration: the issue's TOML as written, what it needs from the daemon
(tcp_listen), its data ports, and its range checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstored.config import ConfigError, load_config
from kvstored.peer.transport import TransportPreference
from kvstored.tiers.config import PeerTierConfig, data_ports

ISSUE_TOML = """\
tcp_listen = "127.0.0.1:7071"          # what peers connect to (TLS/mTLS beyond loopback, as today)
[[tiers]]
kind = "peer"
peers = ["127.0.0.1:7072", "127.0.0.1:7073"]   # static list; the daemon's own address is skipped
transport = "auto"                     # "ucx" | "tcp" | "auto" (ucx when both sides have it)
"""


def test_the_issues_toml_works(tmp_path):
    path = tmp_path / "kvstored.toml"
    path.write_text(ISSUE_TOML)
    cfg = load_config(env={}, config_file=path)
    (peer,) = cfg.tiers
    assert isinstance(peer, PeerTierConfig)
    assert peer.peers == ("127.0.0.1:7072", "127.0.0.1:7073") and peer.transport is TransportPreference.AUTO
    assert data_ports(peer, cfg.tcp_listen) == (8071, 9071)  # tcp_listen's port + 1000 and + 2000


def test_flags_and_environment_take_lists_and_dns():
    cfg = load_config(
        {
            "tcp_listen": "127.0.0.1:7070",
            "tiers": ["kind=peer,peers=10.0.0.2:7070 10.0.0.3:7070,transport=tcp,tcp_port=0"],
        },
        env={},
    )
    assert cfg.tiers[0].peers == ("10.0.0.2:7070", "10.0.0.3:7070") and cfg.tiers[0].tcp_port == 0
    cfg = load_config(
        env={
            "KVSTORED_TCP_LISTEN": "127.0.0.1:7070",
            "KVSTORED_TIERS": "kind=peer,peers_dns=kvstored-peers.kvstored.svc:7070",
        }
    )
    assert cfg.tiers[0].peers_dns == "kvstored-peers.kvstored.svc:7070" and cfg.tiers[0].peers == ()


def test_a_peer_tier_without_tcp_listen_names_both():
    with pytest.raises(ConfigError) as err:
        load_config({"tiers": ["kind=peer,peers=127.0.0.1:7072"]}, env={})
    assert "peer tier" in str(err.value) and "tcp_listen" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "listen", "words"),
    [
        ("kind=peer", "127.0.0.1:7070", ["peers", "peers_dns"]),
        ("kind=peer,peers=10.0.0.2", "127.0.0.1:7070", ["HOST:PORT"]),
        ("kind=peer,peers=10.0.0.2:7070,transport=rdma", "127.0.0.1:7070", ["rdma", "auto"]),
        ("kind=peer,peers=10.0.0.2:7070,fetch_timeout_s=0", "127.0.0.1:7070", ["fetch_timeout_s"]),
        ("kind=peer,peers=10.0.0.2:7070,index_entries=0", "127.0.0.1:7070", ["index_entries"]),
        ("kind=peer,peers=10.0.0.2:7070,tcp_port=70000", "127.0.0.1:7070", ["port"]),
        ("kind=peer,peers=10.0.0.2:7070", "127.0.0.1:64000", ["ucx_port", "above 65535"]),
        ("kind=peer,peers=10.0.0.2:7070,tcp_port=7070", "127.0.0.1:7070", ["tcp_port", "tcp_listen"]),
        ("kind=peer,peers=10.0.0.2:7070,streams=0", "127.0.0.1:7070", ["streams"]),
        ("kind=peer,peers=10.0.0.2:7070,streams=3,tcp_connections=2", "127.0.0.1:7070", ["streams", "tcp_connections"]),
    ],
)
def test_bad_peer_options_are_named(spec, listen, words):
    with pytest.raises(ConfigError) as err:
        load_config({"tcp_listen": listen, "tiers": [spec]}, env={})
    for word in words:
        assert word in str(err.value), str(err.value)


def test_at_most_one_peer_tier():
    with pytest.raises(ConfigError, match="at most one peer tier"):
        load_config(
            {
                "tcp_listen": "127.0.0.1:7070",
                "tiers": ["kind=peer,peers=10.0.0.2:7070", "kind=peer,name=p2,peers=10.0.0.3:7070"],
            },
            env={},
        )


def test_the_peer_tier_goes_anywhere_in_the_ladder(tmp_path: Path):
    cfg = load_config(
        {
            "tcp_listen": "127.0.0.1:7070",
            "tiers": [f"kind=fs,root={tmp_path},bytes=1GiB", "kind=peer,peers=10.0.0.2:7070", "kind=s3,bucket=kv"],
        },
        env={},
    )
    assert [t.name for t in cfg.tiers] == ["fs", "peer", "s3"]
