# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer data plane: moving chunk bytes between daemons' pools over TCP or UCX (see transport.py
for the contract). The peer tier and its gRPC control plane build on it."""

from kvstored.peer.errors import PeerError, PeerUnreachable, ProtocolError, TransportUnavailable
from kvstored.peer.factory import choose_transport, local_transports, make_link, make_server
from kvstored.peer.quarantine import Quarantine
from kvstored.peer.transport import (
    Ask,
    LinkCounters,
    PeerAddress,
    PeerLink,
    PeerServer,
    Receipt,
    ReceiveOutcome,
    ReceiveResult,
    SendOrder,
    SendOutcome,
    SendResult,
    ServerCounters,
    Slot,
    Source,
    Transfer,
    TransportConfig,
    TransportKind,
    TransportPreference,
    UcxConfig,
)

__all__ = [
    "Ask",
    "LinkCounters",
    "PeerAddress",
    "PeerError",
    "PeerLink",
    "PeerServer",
    "PeerUnreachable",
    "ProtocolError",
    "Quarantine",
    "ReceiveOutcome",
    "ReceiveResult",
    "Receipt",
    "SendOrder",
    "SendOutcome",
    "SendResult",
    "ServerCounters",
    "Slot",
    "Source",
    "Transfer",
    "TransportConfig",
    "TransportKind",
    "TransportPreference",
    "TransportUnavailable",
    "UcxConfig",
    "choose_transport",
    "local_transports",
    "make_link",
    "make_server",
]
