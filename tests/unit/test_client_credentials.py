# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""ClientCredentials.may_read_write: access(2)'s answer for reading and writing, from a file's
owner, group and mode, and the session socket's peer as the kernel reports it."""

from __future__ import annotations

import os
import socket

import pytest

from kvstored.server.credentials import ClientCredentials, client_credentials

USER = ClientCredentials(pid=1, uid=1000, gid=1000, groups=frozenset({1000, 27}))


def stat_of(uid: int, gid: int, mode: int) -> os.stat_result:
    return os.stat_result((0o100000 | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("uid", "gid", "mode", "allowed"),
    [
        (1000, 0, 0o600, True),  # the owner, rw
        (1000, 0, 0o400, False),  # the owner, read only
        (1000, 0, 0o066, False),  # the owner's bits decide for the owner, not the group's or others'
        (0, 27, 0o660, True),  # a supplementary group, rw
        (0, 1000, 0o660, True),  # the primary group
        (0, 27, 0o640, False),
        (0, 27, 0o606, False),  # in the group: the group's bits decide, not the others'
        (0, 0, 0o666, True),  # others, rw
        (0, 0, 0o664, False),
    ],
)
def test_access_follows_the_mode_bits_for_owner_group_and_others(uid, gid, mode, allowed):
    assert USER.may_read_write(stat_of(uid, gid, mode)) is allowed


def test_root_may_open_anything():
    root = ClientCredentials(pid=1, uid=0, gid=0, groups=frozenset())
    assert root.may_read_write(stat_of(1000, 1000, 0o000))


def test_a_socket_peer_is_this_process():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        creds = client_credentials(a)
    assert (creds.pid, creds.uid, creds.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert creds.groups == frozenset(os.getgroups())
