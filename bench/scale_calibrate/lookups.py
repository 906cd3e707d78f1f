# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Local and remote Lookup costs, the peer fetch round trip, and S3 PUT/GET latency per chunk."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import grpc
import numpy as np

from bench.lib.daemons import process_cpu_seconds
from bench.lib.s3 import start_s3
from bench.scale_calibrate.common import SMALL, new_keys, ns_fields, timed
from bench.scale_calibrate.daemons import Pair
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc


def measure_lookups_and_fetch(pair: Pair, reps: int) -> dict[str, Any]:
    a, b = pair.a, pair.b
    out: dict[str, Any] = {}
    print("lookups and a peer fetch", flush=True)
    with b.client() as kv_b, a.client() as kv_a:
        ns_b, ns_a = (kv.register_namespace(**ns_fields("4k", SMALL)) for kv in (kv_b, kv_a))
        misses = new_keys(256, "")
        for _ in range(5):
            kv_b.lookup(ns_b, misses)
        t1 = timed(lambda: kv_b.lookup(ns_b, misses[:1]), reps)
        t256 = timed(lambda: kv_b.lookup(ns_b, misses), reps)
        out["local"] = {
            "basis": f"B's Lookup (unix socket) of keys nobody holds (RAM, fs, peer index asked); median of {reps}",
            "one_key_ms": t1 * 1e3,
            "keys_256_ms": t256 * 1e3,
            "per_key_us": (t256 - t1) / 255 * 1e6,
        }

        # What asking a remote directory costs: a Lookup over A's TCP listener, keys in A's RAM.
        held = new_keys(64, "held")
        kv_a.store(ns_a, held, np.zeros((len(held), SMALL), np.uint8))
        with grpc.insecure_channel(a.address) as channel:
            ask = functools.partial(pb_grpc.KVStoreStub(channel).Lookup, timeout=10)
            for _ in range(5):
                ask(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held))
            r1 = timed(lambda: ask(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held[:1])), reps)
            cpu0, w0 = process_cpu_seconds(a.pid), time.monotonic()
            r64 = timed(lambda: ask(pb.LookupRequest(namespace_id=ns_a.namespace_id, keys=held)), reps)
            cpu1, w1 = process_cpu_seconds(a.pid), time.monotonic()
        out["remote"] = {
            "basis": f"Lookup over A's TCP listener (plaintext gRPC, loopback), keys in A's RAM; median of {reps}; "
            "A's CPU per 64-key call",
            "one_key_ms": r1 * 1e3,
            "keys_64_ms": r64 * 1e3,
            "server_cpu_ms_per_call": max(0.0, cpu1 - cpu0 - pair.a_idle_cpu_per_s * (w1 - w0)) / reps * 1e3,
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
            "basis": f"A loads one 4 KiB chunk only B holds (fetch order, TCP data plane, promotion into A's RAM), "
            f"minus loading it again from A's RAM; medians of {reps}",
            "peer_load_ms": peer * 1e3,
            "local_load_ms": local * 1e3,
            "round_trip_ms": (peer - local) * 1e3,
        }
    return out


def measure_s3(kind: str, chunk_bytes: int, reps: int) -> dict[str, Any]:
    if kind == "none":
        return {"server": None, "note": "--s3 none: not measured"}
    print("S3 PUT/GET latency", flush=True)
    try:
        server = start_s3(kind, memstore_bytes=max(256 << 20, 4 * reps * chunk_bytes))
    except RuntimeError as exc:
        return {"server": None, "note": str(exc)}
    try:
        s3, bucket = server.client(), server.new_bucket(f"scale-calibrate-{os.getpid()}")
        out: dict[str, Any] = {"server": server.kind, "chunk_bytes": chunk_bytes, "reps": reps}
        for label, size in (("chunk", chunk_bytes), ("small", SMALL)):
            out[f"put_{label}_ms"], out[f"get_{label}_ms"] = put_get_ms(s3, bucket, label, os.urandom(size), reps)
        floor = "moto_server keeps objects in RAM" if server.kind == "moto" else "a memstore OSD: latencies are a floor"
        out["basis"] = (
            f"boto3 PUT then GET of {reps} objects of {chunk_bytes >> 20} MiB and of 4 KiB, one at a time, "
            f"medians, against {server.kind} on loopback ({floor})"
        )
        if server.note:
            out["note"] = server.note
        return out
    finally:
        server.stop()


def put_get_ms(s3: Any, bucket: str, prefix: str, body: bytes, reps: int) -> tuple[float, float]:
    """Median latencies (ms) of PUTting `reps` objects of `body` one at a time, then GETting each."""
    puts, gets = iter(range(reps)), iter(range(reps))
    put = timed(lambda: s3.put_object(Bucket=bucket, Key=f"{prefix}/{next(puts)}", Body=body), reps)
    get = timed(lambda: s3.get_object(Bucket=bucket, Key=f"{prefix}/{next(gets)}")["Body"].read(), reps)
    return put * 1e3, get * 1e3
