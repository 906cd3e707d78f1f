# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Local and remote Lookup costs and the peer fetch round trip."""

from __future__ import annotations

import functools
import time
from typing import Any

import grpc
import numpy as np

from bench.lib.daemons import process_cpu_seconds
from bench.scale_calibrate.common import SMALL, new_keys, ns_fields, timed
from bench.scale_calibrate.daemons import Pair
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc


def measure_lookups_and_fetch(pair: Pair, reps: int) -> dict[str, Any]:
    a, b = pair.a, pair.b
    small = ns_fields("4k", SMALL)
    out: dict[str, Any] = {}
    print("lookups and a peer fetch", flush=True)
    with b.client() as kv_b, a.client() as kv_a:
        ns_b = kv_b.register_namespace(**small)
        ns_a = kv_a.register_namespace(**small)
        misses = new_keys(256, "")
        one = misses[:1]
        for _ in range(5):
            kv_b.lookup(ns_b, misses)
        t1 = timed(lambda: kv_b.lookup(ns_b, one), reps)
        t256 = timed(lambda: kv_b.lookup(ns_b, misses), reps)
        out["local"] = {
            "basis": f"B's Lookup (unix socket, client library) of keys nobody holds: RAM, fs and the peer index "
            f"asked; median of {reps}",
            "one_key_ms": t1 * 1e3,
            "keys_256_ms": t256 * 1e3,
            "per_key_us": (t256 - t1) / 255 * 1e6,
        }

        # What asking a remote directory costs: a Lookup over A's TCP listener, keys in A's RAM.
        held = new_keys(64, "held")
        kv_a.store(ns_a, held, np.zeros((len(held), SMALL), np.uint8))
        with grpc.insecure_channel(a.address) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            for _ in range(5):
                stub.Lookup(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held), timeout=10)
            ask = functools.partial(stub.Lookup, timeout=10)
            r1 = timed(lambda: ask(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held[:1])), reps)
            cpu0, w0 = process_cpu_seconds(a.pid), time.monotonic()
            r64 = timed(lambda: ask(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held)), reps)
            cpu1, w1 = process_cpu_seconds(a.pid), time.monotonic()
        server_cpu = max(0.0, cpu1 - cpu0 - pair.a_idle_cpu_per_s * (w1 - w0)) / reps
        out["remote"] = {
            "basis": f"Lookup over A's TCP listener (plaintext gRPC on loopback; a directory would be asked so), "
            f"keys in A's RAM; median of {reps}; A's CPU per 64-key call",
            "one_key_ms": r1 * 1e3,
            "keys_64_ms": r64 * 1e3,
            "server_cpu_ms_per_call": server_cpu * 1e3,
        }

        # A peer fetch: one 4 KiB chunk only B holds, loaded through A (lookup, order, bytes, promotion).
        remote = new_keys(reps, "fetch")
        kv_b.store(ns_b, remote, np.zeros((len(remote), SMALL), np.uint8))
        pair.cluster.wait_indexed(0, 1, len(remote))
        buf = np.empty((1, SMALL), np.uint8)
        keys = iter([*remote, *remote])  # from B, then again from A's RAM

        def load_next() -> None:
            if kv_a.load(ns_a, [next(keys)], buf) != 1:
                raise RuntimeError("A could not load a chunk B holds")

        peer, local = timed(load_next, len(remote)), timed(load_next, len(remote))
        out["fetch"] = {
            "basis": f"A's client loads one 4 KiB chunk only B holds (A's peer index names B: fetch order over gRPC, "
            f"bytes over the TCP data plane, checksum, promotion into A's RAM), minus loading it again "
            f"from A's RAM; medians of {reps}",
            "peer_load_ms": peer * 1e3,
            "local_load_ms": local * 1e3,
            "round_trip_ms": (peer - local) * 1e3,
        }
    return out
