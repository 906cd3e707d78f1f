# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer data plane's exceptions. Transfers never raise them to callers (results carry an
outcome); they are raised inside the transports and by the setup calls named below."""

from __future__ import annotations


class PeerError(Exception):
    """Base of the peer data plane's errors."""


class TransportUnavailable(PeerError):
    """The transport asked for cannot be used here (ucxx not installed, no transport both sides
    have, UCX bound to another event loop): raised by choose_transport and by UCX start-up."""


class PeerUnreachable(PeerError):
    """Connecting or the handshake failed, or the connection was lost."""


class ProtocolError(PeerError):
    """The peer sent something that is not this protocol (magic, version, transfer id, length)."""
