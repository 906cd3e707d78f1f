# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Who is at the other end of a session socket (SO_PEERCRED, and the process's groups), and
whether that user could open a file read-write itself.

A region named by path is opened by the daemon, with the daemon's rights; without this check a
client could name a file it may not open and read or write it through the daemon (a region
passed as an fd needs none: the client proved access by opening it)."""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass

_RW = 0o6  # read and write, in the "other" position of a mode


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # supplementary groups, as the process had them at the session's start

    def may_read_write(self, st: os.stat_result) -> bool:
        """What access(2) would say for this user, for reading and writing the file `st`
        describes (root may; the owner, group and others by their mode bits)."""
        if self.uid == 0:
            return True
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid == self.uid:
            bits = mode >> 6
        elif st.st_gid == self.gid or st.st_gid in self.groups:
            bits = mode >> 3
        else:
            bits = mode
        return bits & _RW == _RW


def client_credentials(conn: socket.socket) -> ClientCredentials:
    """The connecting process's pid, uid, gid and supplementary groups."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return ClientCredentials(pid, uid, gid, _groups(pid))


def _groups(pid: int) -> frozenset[int]:
    """The process's supplementary groups (none known if it is gone or /proc hides it)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()
