# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Per-call latency with the fast path (calls over the session socket) against gRPC, in one run.

Three sync Clients on one daemon, interleaved call by call: the default (the fast path, slots
reserved ahead, the key index), the fast path with a round trip per call and gRPC; 1-chunk stores
and loads (pool mapping and region), 1- and 256-key lookups, and an empty gRPC round trip. Every
loaded chunk is checked. Method and results: docs/benchmarks.md#per-call-latency.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.lib.buffers import ShmFile, populate
from bench.lib.call_latency import interleaved, timed_call
from bench.lib.daemons import Daemon
from bench.lib.report import MIB, percentile, print_aligned, write_json
from kvstored_client import Client, NamespaceSpec

LOOKUP_KEYS = 256
STORE_KEYS = 16  # distinct keys the 1-chunk stores cycle through (each deleted before it is stored again)


def measure(socket: str, chunk: int, iters: int, warmup: int) -> dict[str, dict[str, float]]:
    spec = NamespaceSpec(model="bench-fast-path", dtype="uint8", chunk_bytes=chunk)
    fast = Client(socket, deadline_s=30.0, client_name="bench-fast", fast_path=True)
    trip = Client(socket, deadline_s=30.0, client_name="bench-trip", fast_path=True, store_ahead=False, key_index=False)
    grpc_ = Client(socket, deadline_s=30.0, client_name="bench-grpc", fast_path=False)
    src = np.full(chunk, 7, dtype=np.uint8)  # (written whole: no first-touch faults in the timed calls)
    out = populate(np.zeros(chunk, dtype=np.uint8))
    # One region for the clients: chunk 0 is the stores' source, chunk 1 the loads' target.
    region_file = ShmFile(2 * chunk, prefix="kvstored-bench-fast-path")
    region_file.array[:chunk] = 7
    with fast, trip, grpc_:
        ns = fast.register_namespace(spec)
        trip.register_namespace(spec)
        grpc_.register_namespace(spec)
        lookup_keys = [b"L%031d" % i for i in range(LOOKUP_KEYS)]
        if fast.store(ns, lookup_keys, [src] * LOOKUP_KEYS).dropped:
            raise RuntimeError("could not store the lookup keys")
        grpc_.lookup(ns, lookup_keys[:1])  # opens grpc_'s channel
        health = health_pb2_grpc.HealthStub(grpc_._get_channel())
        check = health_pb2.HealthCheckRequest()
        counter = iter(range(1 << 62))

        def calls(kv: Client) -> dict[str, Callable[[], float]]:
            """kv's calls of each kind (on a region of its own), timed alone (the set-up around each untimed)."""
            region = kv.register_region(region_file.path)

            def store(what: str, call: Callable[[bytes], Any], name: bytes) -> Callable[[], float]:
                def fresh_key() -> bytes:
                    key = name % (next(counter) % STORE_KEYS)
                    kv.delete(ns, [key])  # so that every store copies
                    return key

                return timed_call(call, lambda r: r.stored == 1, f"a 1-chunk {what} did not store", fresh_key)

            def load(what: str, call: Callable[[Any], int], buf: np.ndarray, at: int) -> Callable[[], float]:
                def clear() -> None:
                    buf[at : at + 8] = 0

                failed = f"a 1-chunk {what} did not load the stored bytes"
                return timed_call(call, lambda n: n == 1 and (buf[at : at + chunk] == 7).all(), failed, clear)

            def hits(n: int) -> Callable[[], float]:
                what = f"a lookup of {n} cached keys missed"
                return timed_call(lambda _: kv.lookup(ns, lookup_keys[:n]).prefix_hits, lambda h: h == n, what)

            one = lookup_keys[:1]
            return {
                "store 1 chunk": store("store", lambda key: kv.store(ns, [key], src), b"S%031d"),
                "load 1 chunk": load("load", lambda _: kv.load(ns, one, out), out, 0),
                "region store 1 chunk": store(
                    "region store", lambda key: kv.store_from_region(ns, region, [key], [0]), b"R%031d"
                ),
                "region load 1 chunk": load(
                    "region load", lambda _: kv.load_to_region(ns, region, one, [chunk]), region_file.array, chunk
                ),
                "lookup 1 key": hits(1),
                f"lookup {LOOKUP_KEYS} keys": hits(LOOKUP_KEYS),
            }

        kinds = {"empty gRPC round trip": timed_call(lambda _: health.Check(check, timeout=5.0))}
        for label, kv in (("fast", fast), ("round trip", trip), ("gRPC", grpc_)):
            kinds.update({f"{name} ({label})": run for name, run in calls(kv).items()})
        samples = interleaved(kinds, iters, warmup)
        fast.delete(ns, lookup_keys)
    region_file.close()
    return {k: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "n": len(v)} for k, v in samples.items()}


def report(results: dict[str, dict[str, float]]) -> None:
    print("fast: the default client; round trip: store_ahead=False, key_index=False; gRPC: fast_path=False")
    table = [["call", "p50 ms", "p99 ms", "round trip / fast (p50)", "gRPC / fast (p50)"]]
    for name, r in results.items():
        ratios = ["", ""]
        if name.endswith("(fast)"):
            ratios = [
                f"{results[name.replace('(fast)', o)]['p50_ms'] / r['p50_ms']:.2f}x" for o in ("(round trip)", "(gRPC)")
            ]
        table.append([name, f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", *ratios])
    print_aligned(table, right={1, 2, 3, 4})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fast_path", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000, help="timed calls of each kind (default 2000)")
    ap.add_argument("--warmup", type=int, default=50, help="untimed calls of each kind first (default 50)")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size in MiB (default 2)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    chunk = int(args.chunk_mib * MIB)
    with Daemon(cpu_bytes=max(1 << 30, 2 * (LOOKUP_KEYS + STORE_KEYS) * chunk)) as daemon:  # room: no eviction
        results = measure(str(daemon.socket), chunk, args.iters, args.warmup)
    report(results)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
