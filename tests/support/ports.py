# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A free loopback TCP port, for the servers the tests and benches start."""

from __future__ import annotations

import socket

_given: set[int] = set()  # the kernel may hand the same free port out twice in a row


def free_port() -> int:
    """A port free now and not given out before by this process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port
