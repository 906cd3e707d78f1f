# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer handshake's content (pure): what a daemon says about itself, and whether two daemons
can share chunks at all.

Two daemons share chunks only if they frame and check chunks alike (the chunk format version)
and derive namespace ids alike (the fingerprint: the id of a fixed namespace spec, so a change
in the derivation shows before any chunk is asked for, instead of as silent zero hits).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstored.chunks.chunkfile import VERSION as CHUNK_FORMAT_VERSION
from kvstored.peer.membership import Hello
from kvstored.peer.transport import TransportKind
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.keys import namespace_id_for

PROTOCOL_VERSION = 1
# A fixed spec whose id every daemon derives the same way (if its derivation is the same).
FINGERPRINT_SPEC = ("kvstored-peer-fingerprint", "bfloat16", 2 << 20, "tp1-pp1-block16", b"", 32)


def namespace_fingerprint() -> str:
    return namespace_id_for(*FINGERPRINT_SPEC)


@dataclass(frozen=True)
class LocalHello:
    """This daemon, as its handshake describes it."""

    incarnation: int
    transports: frozenset[TransportKind]  # what it serves on
    tcp_port: int
    ucx_port: int
    tiers: tuple[str, ...]  # RAM and the local tiers it serves peers from
    address: str

    def to_proto(self) -> pb.PeerHello:
        return pb.PeerHello(
            protocol_version=PROTOCOL_VERSION,
            incarnation=self.incarnation,
            chunk_format_version=CHUNK_FORMAT_VERSION,
            namespace_fingerprint=namespace_fingerprint(),
            transports=sorted(t.value for t in self.transports),
            tcp_port=self.tcp_port,
            ucx_port=self.ucx_port,
            tiers=list(self.tiers),
            address=self.address,
        )


def incompatibility(remote: pb.PeerHello) -> str:
    """Why this daemon and the one that sent `remote` cannot share chunks ("" if they can)."""
    if remote.protocol_version != PROTOCOL_VERSION:
        return (
            f"peer protocol version {remote.protocol_version}, this daemon speaks {PROTOCOL_VERSION}: "
            f"run the same kvstored version on every node"
        )
    if remote.chunk_format_version != CHUNK_FORMAT_VERSION:
        return (
            f"chunk format version {remote.chunk_format_version}, this daemon's is {CHUNK_FORMAT_VERSION}: "
            f"run the same kvstored version on every node"
        )
    if remote.namespace_fingerprint != namespace_fingerprint():
        return (
            f"namespace ids derived differently (fingerprint {remote.namespace_fingerprint[:16]!r}, this "
            f"daemon's {namespace_fingerprint()[:16]!r}): their keys would never match; run the same "
            f"kvstored version on every node"
        )
    return ""


def hello_from_proto(remote: pb.PeerHello) -> Hello:
    transports = set()
    for name in remote.transports:
        try:
            transports.add(TransportKind(name))
        except ValueError:  # a transport a newer peer offers and this daemon does not know
            continue
    return Hello(
        remote.incarnation, frozenset(transports), remote.tcp_port, remote.ucx_port, tuple(remote.tiers), remote.address
    )
