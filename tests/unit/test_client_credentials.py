# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""ClientCredentials: who connected (SO_PEERCRED), and that only a file's owner (or root) may have
the daemon map it by path, whatever its mode says to groups and others."""

from __future__ import annotations

import os
import socket

import pytest

from kvstored.server.credentials import ClientCredentials, client_credentials

USER = ClientCredentials(pid=1, uid=1000, gid=1000)


def stat_of(uid: int, gid: int, mode: int) -> os.stat_result:
    return os.stat_result((0o100000 | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("uid", "gid", "mode", "allowed"),
    [
        (1000, 0, 0o600, True),  # its own file
        (1000, 0, 0o000, True),  # (its owner could chmod it: the mode is no barrier to them)
        (0, 1000, 0o660, False),  # its group may write it, but the file is not its own
        (0, 0, 0o666, False),  # everybody may: the file could still sit in another user's private directory
        (2**31 + 5, 0, 0o600, False),
    ],
)
def test_only_the_owner_may_name_a_file(uid, gid, mode, allowed):
    assert USER.may_map(stat_of(uid, gid, mode)) is allowed


def test_root_may_name_anything():
    assert ClientCredentials(pid=1, uid=0, gid=0).may_map(stat_of(1000, 1000, 0o000))


def test_uids_past_2_to_the_31_are_read_unsigned():
    high = ClientCredentials(pid=1, uid=2**31 + 5, gid=2**31 + 5)
    assert high.may_map(stat_of(2**31 + 5, 0, 0o600))


def test_a_socket_peer_is_this_process():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        creds = client_credentials(a)
    assert creds == ClientCredentials(os.getpid(), os.geteuid(), os.getegid())
