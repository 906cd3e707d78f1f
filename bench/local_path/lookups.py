# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Lookup latency of 1 and 256 keys beside an empty gRPC round trip."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.lib.buffers import populate
from bench.lib.report import (
    percentile,
)
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

        def check() -> None:
            health.Check(health_req, timeout=5.0)

        def lookup1() -> None:
            if client.lookup(ns, keys[:1]).prefix_hits != 1:
                raise RuntimeError("lookup of a cached key missed")

        def lookup256() -> None:
            if client.lookup(ns, keys).prefix_hits != LOOKUP_KEYS:
                raise RuntimeError("lookup of cached keys missed")

        def raw256() -> None:
            kv.Lookup(raw_req, timeout=5.0)

        kinds: dict[str, Callable[[], None]] = {
            "empty_rtt": check,
            "lookup_1": lookup1,
            "lookup_256": lookup256,
            "raw_lookup_256": raw256,
        }
        names = list(kinds)
        samples: dict[str, list[float]] = {k: [] for k in names}
        perf = time.perf_counter
        for i in range(warmup + iters):
            # rotate the order so no kind always follows the same one
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                fn = kinds[name]
                t0 = perf()
                fn()
                t1 = perf()
                if i >= warmup:
                    samples[name].append((t1 - t0) * 1e3)
        client.delete(ns, keys)
    return {
        k: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "mean_ms": float(np.mean(v)), "n": len(v)}
        for k, v in samples.items()
    }
