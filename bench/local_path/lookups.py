# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Lookup latency of 1 and 256 keys beside an empty gRPC round trip."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.lib.buffers import populate
from bench.lib.call_latency import interleaved, timed_call
from bench.lib.report import percentile
from bench.local_path.clients import LOOKUP_KEYS, MODEL, make_key


def run_lookups(cfg: dict[str, Any], iters: int, warmup: int) -> dict[str, Any]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvstored_client import Client, NamespaceSpec
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

    chunk = cfg["chunk_bytes"]
    with Client(cfg["socket"], deadline_s=30.0, client_name="bench-lookup") as client:
        ns = client.register_namespace(NamespaceSpec(model=MODEL, dtype="uint8", chunk_bytes=chunk))
        keys = [make_key(99, 0, i, salt=7) for i in range(LOOKUP_KEYS)]
        one = populate(np.empty(chunk, dtype=np.uint8))
        r = client.store(ns, keys, [one] * LOOKUP_KEYS)  # same bytes for every key: content is irrelevant
        if r.stored + r.already_present != LOOKUP_KEYS:
            raise RuntimeError(f"could not store the lookup keys: {r}")
        client.lookup(ns, keys[:1])  # creates the channel
        channel = client._channel  # the very channel Client.lookup uses
        health = health_pb2_grpc.HealthStub(channel)
        kv = client._get_stub()
        health_req = health_pb2.HealthCheckRequest()
        raw_req = pb.LookupRequest(namespace_id=ns.namespace_id, keys=keys)

        kinds = {
            "empty_rtt": timed_call(lambda _: health.Check(health_req, timeout=5.0)),
            "lookup_1": timed_call(
                lambda _: client.lookup(ns, keys[:1]).prefix_hits, lambda h: h == 1, "lookup of a cached key missed"
            ),
            "lookup_256": timed_call(
                lambda _: client.lookup(ns, keys).prefix_hits,
                lambda h: h == LOOKUP_KEYS,
                "lookup of cached keys missed",
            ),
            "raw_lookup_256": timed_call(lambda _: kv.Lookup(raw_req, timeout=5.0)),
        }
        samples = interleaved(kinds, iters, warmup)
        client.delete(ns, keys)
    return {
        k: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "mean_ms": float(np.mean(v)), "n": len(v)}
        for k, v in samples.items()
    }
