# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Event seqs start again at 1 when the daemon restarts, so a seq alone cannot tell a follower
that it resumes in another run: WatchEvents names its run (`kvstored-incarnation`, initial
metadata) and refuses a resume that names another, however far the new run has got."""

from __future__ import annotations

import json

import grpc
import pytest

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.errors import INCARNATION_KEY
from tests.integration.test_ctl import ctl
from tests.support.data import make_keys, payloads

CHUNK = 64 << 10


def store_some(d, ns_name: str, tag: str, n: int) -> None:
    with d.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        for key in make_keys(tag, n):  # (one event each)
            assert kv.store(ns, [key], payloads([key], CHUNK)).stored == 1


def first_event(stub, **request) -> tuple[int, pb.KvEvent]:
    call = stub.WatchEvents(pb.WatchEventsRequest(**request), timeout=5)
    incarnation = int(dict(call.initial_metadata())[INCARNATION_KEY])
    event = next(iter(call))
    call.cancel()
    return incarnation, event


def test_a_resume_in_another_daemon_run_is_out_of_range_however_far_it_got(daemon_factory, ns_name):
    d = daemon_factory()
    store_some(d, ns_name, "before", 2)
    with d.channel() as channel:
        old, event = first_event(pb_grpc.KVStoreStub(channel), from_seq=1)
    assert event.seq == 1 and old != 0
    d.stop()
    d.start()
    store_some(d, ns_name, "after", 4)  # (the new run's seqs pass the old follower's)
    with d.channel() as channel:
        stub = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.WatchEvents(pb.WatchEventsRequest(from_seq=2, incarnation=old), timeout=5))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert f"seq 2 is of another daemon run (incarnation {old}" in err.value.details()
        new, event = first_event(stub, from_seq=2)  # (0: whichever run serves, checked by range)
        assert new != old and event.seq == 2
        assert first_event(stub, from_seq=2, incarnation=new)[1].seq == 2
    # kvstoredctl says which run each event is of, and refuses a resume in another.
    proc = ctl("events", "--json", "--from-seq", "1", "--count", "1", socket_path=d.socket)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["incarnation"] == new
    proc = ctl("events", "--from-seq", "2", "--incarnation", str(old), "--count", "1", socket_path=d.socket)
    assert proc.returncode == 1 and "is of another daemon run" in proc.stderr, proc.stderr
