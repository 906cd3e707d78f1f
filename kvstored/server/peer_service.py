# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""gRPC servicer of kvstored.v1.Peer: translates the peer control plane's messages to the serving
side (peer_serving.py) and the fetching side's state (the peer tier) and back. No logic of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstored.errors import PeerTierDisabled
from kvstored.events.bus import EventBus
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the peer tier's modules load only when one is configured
    from kvstored.server.peer_serving import PeerServing
    from kvstored.tiers.peer import PeerTier

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Peer"].full_name
DISABLED = 'this daemon has no peer tier ([[tiers]] kind = "peer")'


class PeerService(pb_grpc.PeerServicer):
    def __init__(self, serving: PeerServing | None, tier: PeerTier | None, events: EventBus) -> None:
        self._serving = serving
        self._tier = tier
        self._events = events

    def _need(self) -> PeerServing:
        if self._serving is None or self._serving.hello is None:
            raise PeerTierDisabled(DISABLED)
        return self._serving

    async def Hello(self, request: pb.PeerHello, context) -> pb.PeerHello:
        serving = self._need()
        from kvstored.peer.handshake import incompatibility  # (with a peer tier only: its imports, xxhash)

        serving.check_fetcher(request, incompatibility(request), context.peer())
        assert serving.hello is not None
        return serving.hello.to_proto()

    async def Fetch(self, request: pb.FetchRequest, context) -> pb.FetchResponse:
        return await self._need().fetch(request)

    async def Snapshot(self, request: pb.SnapshotRequest, context):
        for batch in self._need().snapshot(self._events):
            yield batch

    async def Status(self, request: pb.PeerStatusRequest, context) -> pb.PeerStatusResponse:
        serving, tier = self._serving, self._tier
        if serving is None or tier is None:
            return pb.PeerStatusResponse(enabled=False)
        from kvstored.server.peer_status import status

        return status(serving, tier)
