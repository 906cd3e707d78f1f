# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The daemon's fast-path dispatcher over a real tier chain and service: an answer too large for
a packet gives back what it granted and tells the client to ask over gRPC; every call is observed
under its gRPC method's name and status; every answer carries its request's call id."""

from __future__ import annotations

import pytest

from kvstored.namespaces import NamespaceRegistry
from kvstored.server.broker import SessionBroker
from kvstored.server.fast_path import SERVICE, FastPath
from kvstored.server.service import KVStoreService
from kvstored.server.tenants import Tenancy, TenantPolicy
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.protocol import FAST_REPLY_MAX, REPLY_TOO_LARGE
from tests.support.tiers import make_chain

CHUNK = 64 << 10
POOL = 1 << 20


@pytest.fixture
async def rig():
    chain = make_chain([], pool=POOL)
    await chain.start()
    namespaces = NamespaceRegistry(POOL)
    tenancy = Tenancy(chain.ram, chain.arenas, namespaces, TenantPolicy(POOL))
    broker = SessionBroker(chain, tenancy=tenancy)
    service = KVStoreService(chain, broker, namespaces, 64, (), tenancy)
    seen: list[tuple[str, str, str]] = []
    fast = FastPath(service, broker, lambda service, method, code, _s: seen.append((service, method, code)))
    ns = namespaces.register("m", "uint8", CHUNK, "", b"", 32)
    session = broker.open("test", arenas=True)
    yield fast, broker, session, ns, seen
    broker.close_session(session)
    await broker.close()
    await chain.close()


def keys(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


async def test_an_answer_too_large_for_a_packet_is_given_back(rig):
    fast, broker, session, ns, seen = rig
    reserve = pb.SessionRequest(reserve=pb.ReserveRequest(namespace_id=ns.namespace_id, keys=keys(4)))
    reply = pb.SessionReply.FromString(await fast.answer(session, reserve, "reserve", limit=32))
    assert (reply.error.code, reply.error.kind) == ("RESOURCE_EXHAUSTED", REPLY_TOO_LARGE)
    assert session.handles == {}  # the four reservations it granted are released
    reply = pb.SessionReply.FromString(await fast.answer(session, reserve, "reserve", limit=FAST_REPLY_MAX))
    assert [s.state for s in reply.reserve.slots] == [pb.SLOT_STATE_RESERVED] * 4  # the keys are free again
    assert len(session.handles) == 4
    assert seen == [(SERVICE, "Reserve", "RESOURCE_EXHAUSTED"), (SERVICE, "Reserve", "OK")]


async def test_the_request_names_the_connections_session_whatever_it_says(rig):
    fast, broker, session, ns, seen = rig
    release = pb.SessionRequest(release=pb.ReleaseRequest(session_id="someone-else", handles=[1]))
    reply = pb.SessionReply.FromString(await fast.answer(session, release, "release", limit=FAST_REPLY_MAX))
    assert (reply.error.code, reply.error.kind) == ("FAILED_PRECONDITION", "HandleNotHeld")
    assert session.session_id in reply.error.message
    assert seen == [(SERVICE, "Release", "FAILED_PRECONDITION")]


async def test_every_answer_carries_its_requests_call_id(rig):
    fast, broker, session, ns, seen = rig
    lookup = pb.SessionRequest(lookup=pb.LookupRequest(namespace_id=ns.namespace_id, keys=keys(2)), call_id=7)
    reply = pb.SessionReply.FromString(await fast.answer(session, lookup, "lookup", limit=FAST_REPLY_MAX))
    assert (reply.WhichOneof("kind"), reply.call_id) == ("lookup", 7)
    release = pb.SessionRequest(release=pb.ReleaseRequest(handles=[1]), call_id=8)  # an error
    reply = pb.SessionReply.FromString(await fast.answer(session, release, "release", limit=FAST_REPLY_MAX))
    assert (reply.WhichOneof("kind"), reply.call_id) == ("error", 8)
    reserve = pb.SessionRequest(reserve=pb.ReserveRequest(namespace_id=ns.namespace_id, keys=keys(4)), call_id=9)
    reply = pb.SessionReply.FromString(await fast.answer(session, reserve, "reserve", limit=32))  # too large
    assert (reply.error.kind, reply.call_id) == (REPLY_TOO_LARGE, 9)
