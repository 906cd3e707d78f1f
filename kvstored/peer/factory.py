# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Which transport two daemons use, and making its link (fetching side) or server (serving side)."""

from __future__ import annotations

from kvstored.peer.errors import TransportUnavailable
from kvstored.peer.transport import (
    PeerAddress,
    PeerLink,
    PeerServer,
    TransportConfig,
    TransportKind,
    TransportPreference,
)
from kvstored.peer.ucx_runtime import ucx_installed


def local_transports() -> frozenset[TransportKind]:
    """What this process can run: TCP always, UCX when ucxx is installed."""
    return frozenset({TransportKind.TCP, TransportKind.UCX}) if ucx_installed() else frozenset({TransportKind.TCP})


def choose_transport(
    preference: TransportPreference,
    local: frozenset[TransportKind],
    remote: frozenset[TransportKind],
) -> TransportKind:
    """AUTO: UCX when both sides have it, else TCP. An explicit choice the two sides don't share
    raises TransportUnavailable naming the side that lacks it."""
    if preference is TransportPreference.AUTO:
        both = local & remote
        if TransportKind.UCX in both:
            return TransportKind.UCX
        if TransportKind.TCP in both:
            return TransportKind.TCP
        raise TransportUnavailable("the peers share no transport")
    kind = TransportKind(preference.value)
    missing = [side for side, kinds in (("this daemon", local), ("the peer", remote)) if kind not in kinds]
    if missing:
        hint = " (install kvstored[ucx])" if kind is TransportKind.UCX else ""
        raise TransportUnavailable(f"transport {kind.value} is not available on {' and '.join(missing)}{hint}")
    return kind


def make_link(kind: TransportKind, address: PeerAddress, config: TransportConfig) -> PeerLink:
    if kind is TransportKind.UCX:
        from kvstored.peer.ucx import UcxLink

        return UcxLink(address, config)
    from kvstored.peer.tcp import TcpLink

    return TcpLink(address, config)


def make_server(kind: TransportKind, host: str, port: int, config: TransportConfig) -> PeerServer:
    if kind is TransportKind.UCX:
        from kvstored.peer.ucx import UcxServer

        return UcxServer(host, port, config)
    from kvstored.peer.tcp import TcpServer

    return TcpServer(host, port, config)
