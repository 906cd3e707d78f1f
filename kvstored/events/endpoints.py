# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Which ZMQ endpoints the publisher binds and which it connects to (vLLM's rule).

Apart from the publisher so that the start-up checks can ask it without importing msgpack and
zmq, which a daemon without ZMQ events does not need."""

from __future__ import annotations


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
