# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A fetch connection goes back to the pool only if nothing waits to be read on it: a peer sends
frames only for an order, so a byte left after an order's last frame (or the peer's close) means
the stream is out of step, and the next order on it would read that byte as its first frame."""

from __future__ import annotations

import socket

from kvstored.peer.tcp import _quiet


def test_only_a_connection_with_nothing_to_read_is_quiet():
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        assert _quiet(a)
        b.sendall(b"x")
        assert not _quiet(a)
        assert a.recv(1) == b"x"  # (the check only peeked)
        assert _quiet(a)
        b.close()
        assert not _quiet(a)  # the peer's end is no quiet connection either
