# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Who is at the other end of a session socket (SO_PEERCRED, as the kernel recorded it at
connect), and whether that user may have the daemon map a file named by path.

A region named by path is opened by the daemon, with the daemon's rights; without this check a
client could name a file it may not open and read or write it through the daemon. The rule is
the file's owner (or root), not a model of access(2): groups, ACLs and the directories on the way
would each need checking, and getting one wrong grants another user's memory. A file shared
otherwise is opened by the client and passed as an fd, which proves access (AttachRegion)."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("iII")  # pid, uid, gid (uid_t and gid_t are unsigned)


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    pid: int
    uid: int
    gid: int

    def may_map(self, st: os.stat_result) -> bool:
        """Whether this user may have the daemon map the file `st` describes: root, or its owner."""
        return self.uid == 0 or st.st_uid == self.uid


def client_credentials(conn: socket.socket) -> ClientCredentials:
    """The connecting process's pid, uid and gid, as they were when it connected."""
    return ClientCredentials(*_UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))
