# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Benchmark of what tenant isolation costs on the local data path (not a test).

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from bench.lib.buffers import ShmFile, each_batch, fill_pattern, populate
from bench.lib.daemons import Daemon, process_cpu_seconds
from bench.lib.report import GIB, MIB, Row, Stats, load_average, machine_info, print_table, write_json

WARM_TARGET = 0.9  # a tenant's steady state should cost next to nothing
# a tenant's phases: (its name in the throughput rows, in the CPU rows, the phase)
TENANT_PHASES = [("pool mapping store", "pool store", "store"), ("pool mapping load", "pool load", "load")]
TENANT_PHASES += [("region store", "region store", "region_store"), ("region load", "region load", "region_load")]


def punch_gib_s(nbytes: int, chunk: int) -> tuple[float, float]:
    """(GiB/s returning touched memfd pages to the kernel in chunk-sized holes, GiB/s of a memcpy
    of the same bytes)."""
    from kvstored.shm.mapping import create_arena_memfd, punch_hole

    fd = create_arena_memfd("bench-punch", nbytes)
    try:
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        arr = np.frombuffer(mapped, dtype=np.uint8)
        src = populate(np.empty(nbytes, dtype=np.uint8))
        arr[:] = src  # every page resident and mapped, as in the daemon and a client
        t0 = time.perf_counter()
        arr[:] = src
        copy_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk):
            punch_hole(fd, off, chunk)
        punch_s = time.perf_counter() - t0
        del arr
        mapped.close()
    finally:
        os.close(fd)
    return nbytes / punch_s / GIB, nbytes / copy_s / GIB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5, help="working set in GiB (default 0.5)")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size in MiB (default 2)")
    ap.add_argument("--batch", type=int, default=64, help="chunks per request (default 64)")
    ap.add_argument("--repeat", type=int, default=5, help="timed repeats (default 5; best is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repeats first (default 1)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    from kvstored_client import Client, NamespaceSpec

    chunk = int(args.chunk_mib * MIB)
    n = -(-int(args.gib * GIB) // chunk)
    ws = n * chunk
    cpu_bytes = -(-int(ws * 2.5) // (64 << 10)) * (64 << 10)
    info = machine_info()
    print(
        f"kvstored tenant-isolation benchmark: working set {ws / GIB:.3f} GiB = {n} chunks of {args.chunk_mib:g} "
        f"MiB, {args.batch} per request, best of {args.repeat} (+{args.warmup} warm-up); RAM tier "
        f"{cpu_bytes / GIB:.2f} GiB; {info['cpus']} CPUs, kernel {info['kernel']}; git {info['git']}"
    )
    load_start = load_average()
    src = populate(np.empty(ws, dtype=np.uint8))
    fill_pattern(src, chunk, seed=7)
    dst = populate(np.empty(ws, dtype=np.uint8))
    region_file = ShmFile(2 * ws, prefix="kvstored-bench-tenants")
    region_file.array[:ws] = src
    offsets_in = [i * chunk for i in range(n)]
    offsets_out = [ws + i * chunk for i in range(n)]
    batches = [(b, min(b + args.batch, n)) for b in range(0, n, args.batch)]
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # client + daemon CPU ms per GiB
    errors: list[str] = []

    with (
        Daemon(cpu_bytes, extra_args=["--tenant-quota", str(ws)]) as daemon,
        Client(daemon.socket, deadline_s=60.0, client_name="bench-tenants") as kv,
    ):
        spec = partial(NamespaceSpec, model="bench/tenants", dtype="uint8", chunk_bytes=chunk)
        namespaces = {
            "public": kv.register_namespace(spec(quota_bytes=ws)),
            "tenant": kv.register_namespace(spec(tenant_salt=b"bench-tenant")),
        }
        region = kv.register_region(region_file.path)
        region_file.unlink()

        def timed(name: str, rep: int, nbytes: int, fn: Callable[[], None]) -> None:
            c0, d0 = time.process_time(), process_cpu_seconds(daemon.pid)
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            c1, d1 = time.process_time(), process_cpu_seconds(daemon.pid)
            if rep >= args.warmup:
                samples.setdefault(name, []).append(nbytes / (t1 - t0) / GIB)
                cpu.setdefault(name, []).append((c1 - c0 + d1 - d0) * 1e3 * GIB / nbytes)

        def one_tenant(who: str, ns: Any, rep: int) -> None:
            keys = [f"{who}/{rep}/{i}".encode().ljust(32, b".") for i in range(n)]
            rkeys = [f"{who}/r{rep}/{i}".encode().ljust(32, b".") for i in range(n)]
            calls: dict[str, Callable[[int, int], int]] = {
                "store": lambda b0, b1: kv.store(ns, keys[b0:b1], src[b0 * chunk : b1 * chunk]).stored,
                "load": lambda b0, b1: kv.load(ns, keys[b0:b1], dst[b0 * chunk : b1 * chunk]),
                "region_store": lambda b0, b1: kv.store_from_region(ns, region, rkeys[b0:b1], offsets_in[b0:b1]).stored,
                "region_load": lambda b0, b1: kv.load_to_region(ns, region, rkeys[b0:b1], offsets_out[b0:b1]),
            }
            dst[:] = 0
            for op, call in calls.items():
                timed(f"{who}_{op}", rep, ws, partial(each_batch, batches, call, errors, f"{who} rep {rep}: {op}"))
                if op == "load" and rep == 0 and not np.array_equal(dst, src):
                    errors.append(f"{who}: loaded bytes differ")
            if rep == 0 and not np.array_equal(region_file.array[ws:], src):
                errors.append(f"{who}: region loaded bytes differ")

        for rep in range(args.warmup + args.repeat):
            order = list(namespaces.items())
            for who, ns in order if rep % 2 else order[::-1]:
                one_tenant(who, ns, rep)

            # A tenant seen for the first time: a fresh arena, every page a hole.
            first = kv.register_namespace(spec(tenant_salt=f"bench-first-{rep}".encode()))
            quarter = batches[: max(1, len(batches) // 4)]
            fkeys = [f"first/{rep}/{i}".encode().ljust(32, b".") for i in range(n)]
            nbytes = sum(b1 - b0 for b0, b1 in quarter) * chunk

            def first_store(first=first, quarter=quarter, fkeys=fkeys) -> None:
                for b0, b1 in quarter:
                    kv.store(first, fkeys[b0:b1], src[b0 * chunk : b1 * chunk])

            timed("first_store", rep, nbytes, first_store)
            for b0, b1 in quarter:
                kv.delete(first, fkeys[b0:b1])
        assert kv.stats().version  # (the daemon is alive and answering)

    punch, copy = punch_gib_s(min(ws, 256 * MIB), chunk)
    region_file.close()
    best = {k: Stats.of(v) for k, v in samples.items()}

    def row(label: str, phase: str, base: str, target: float | None = None) -> Row:
        b = best[phase]
        return Row(label, b.best, "GiB/s", base.replace("_", " "), best[base].best, target, median=b.median)

    def cpu_row(label: str, phase: str, base: str) -> Row:
        median = statistics.median
        return Row(label, median(cpu[phase]), "ms", base.replace("_", " "), median(cpu[base]), higher_is_better=False)

    warm = [(f"tenant {what} (warm)", f"tenant_{op}", f"public_{op}") for what, _, op in TENANT_PHASES]
    rows = [
        Row("public pool mapping store", best["public_store"].best, "GiB/s", median=best["public_store"].median),
        row(*warm[0], WARM_TARGET),
        Row("public pool mapping load", best["public_load"].best, "GiB/s", median=best["public_load"].median),
        *(row(*w, WARM_TARGET) for w in warm[1:]),
        row("first tenant store, fresh arena (first touch)", "first_store", "public_store"),
        Row("returning pages to the kernel (punch)", punch, "GiB/s", "memcpy of the same bytes", copy),
        *(cpu_row(f"CPU per GiB: tenant {what}", f"tenant_{op}", f"public_{op}") for _, what, op in TENANT_PHASES),
        cpu_row("CPU per GiB: first tenant store", "first_store", "public_store"),
    ]
    print()
    print_table(rows, title="results (value = best repeat, median = median repeat; same run)")
    load_end = load_average()
    if max(load_start, load_end) > 1.0:
        print(f"\nWARNING: load average {load_start:.2f} at start, {load_end:.2f} at end: noisy figures.")
    for e in errors:
        print(f"ERROR: {e}")
    if args.json:
        doc = {"rows": [r.to_json() for r in rows], "samples": samples, "cpu_ms_per_gib": cpu}
        write_json(args.json, doc | {"errors": errors, "machine": info})
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
