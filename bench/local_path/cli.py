# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The local-path benchmark's command line: `python -m bench.local_path`."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from bench.lib.daemons import Daemon
from bench.lib.report import GIB, MIB, Row, load_average, machine_info, print_table, write_json
from bench.local_path import __doc__ as DOC
from bench.local_path.clients import LOOKUP_KEYS, LOOKUP_TARGET, POOL_TARGET, REGION_TARGET, run_clients
from bench.local_path.lookups import run_lookups
from bench.local_path.report import data_rows, lookup_rows, print_breakdown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.local_path", description=(DOC or "").split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="working set in GiB (default 1)")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size in MiB (default 2)")
    ap.add_argument("--batch", type=int, default=64, help="chunks per request (default 64: one RPC per batch)")
    ap.add_argument("--repeat", type=int, default=7, help="repeats of each measurement (default 7; best is reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up repeats before those (default 1)")
    ap.add_argument("--procs", default="1,2", help="client process counts (default 1,2)")
    ap.add_argument("--lookup-iters", type=int, default=2000, help="timed calls of each lookup kind (default 2000)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument(
        "--nt-threshold",
        metavar="BYTES",
        type=int,
        help="what-if: run the daemon and the client processes with GLIBC_TUNABLES="
        "glibc.cpu.x86_non_temporal_threshold=BYTES (memcpy uses non-temporal stores from that size up)",
    )
    ap.add_argument(
        "--pool-pages",
        choices=("4k", "thp", "hugetlb"),
        default="4k",
        help="the daemon's pool_pages (hugetlb needs vm.nr_hugepages; thp needs shmem_enabled=advise); "
        "bench/pool.py compares the modes alone",
    )
    ap.add_argument("--numa-node", default="", help="the daemon's numa_node (a node or interleave; default unset)")
    args = ap.parse_args(argv)
    if args.nt_threshold is not None:
        # glibc reads tunables at process start: the daemon and the spawned clients inherit this
        tunable = f"glibc.cpu.x86_non_temporal_threshold={args.nt_threshold:#x}"
        old = os.environ.get("GLIBC_TUNABLES")
        os.environ["GLIBC_TUNABLES"] = f"{old}:{tunable}" if old else tunable

    t_start = time.perf_counter()
    chunk = int(args.chunk_mib * MIB)
    procs = [int(p) for p in args.procs.split(",") if p]
    chunks = -(-int(args.gib * GIB) // chunk)
    chunks = -(-chunks // max(procs)) * max(procs)  # every process gets the same share
    working_set = chunks * chunk
    page = 64 << 10
    cpu_bytes = max(int(working_set * 1.5), (LOOKUP_KEYS + 16) * chunk)
    cpu_bytes = -(-cpu_bytes // page) * page

    print(
        f"kvstored local-path benchmark: working set {working_set / GIB:.3f} GiB = {chunks} chunks of "
        f"{args.chunk_mib:g} MiB, {args.batch} chunks per request, best of {args.repeat} repeats "
        f"(+{args.warmup} warm-up); "
        f"RAM tier {cpu_bytes / GIB:.2f} GiB"
    )
    info = machine_info()
    if info["glibc_tunables"]:
        print(f"GLIBC_TUNABLES={info['glibc_tunables']} (daemon and clients)")
    print(
        f"machine: {info['cpus']} CPUs ({info['cpu_model']}), kernel {info['kernel']}, python {info['python']}, "
        f"{info['glibc']}, numpy {info['numpy']}, grpcio {info['grpcio']}; git {info['git']}"
    )
    nt = info["glibc_non_temporal_threshold"]
    if nt is not None:
        sizes = ", ".join(f"{working_set // n / MIB:.0f} MiB ({n}p)" for n in procs)
        print(
            f"glibc non-temporal memcpy threshold: {nt / MIB:.1f} MiB; chunk copies ({args.chunk_mib:g} MiB) are "
            f"{'below' if chunk < nt else 'at or above'} it; one-copy baseline copies per process: {sizes}"
        )
    load_start = load_average()
    print(f"load average at start: {load_start:.2f}")

    results: dict[int, Any] = {}
    pool_args = ["--pool-pages", args.pool_pages] + (["--numa-node", args.numa_node] if args.numa_node else [])
    print(f"pool: {args.pool_pages} pages, NUMA {args.numa_node or 'unset'}")
    with Daemon(cpu_bytes, extra_args=pool_args) as daemon:
        print(f"daemon pid {daemon.pid} on {daemon.socket} (ready in {daemon.start_s:.2f}s)")
        cfg = {
            "socket": str(daemon.socket),
            "chunk_bytes": chunk,
            "chunks": chunks,
            "batch": args.batch,
            "repeat": args.repeat,
            "warmup": args.warmup,
        }
        for nprocs in procs:
            t0 = time.perf_counter()
            results[nprocs] = run_clients(nprocs, cfg, daemon)
            print(
                f"  {nprocs} client process(es): done in {time.perf_counter() - t0:.1f}s "
                f"(buffer set-up {results[nprocs]['setup_s']:.1f}s)",
                flush=True,
            )
        t0 = time.perf_counter()
        lookups = run_lookups(cfg, args.lookup_iters, warmup=max(50, args.lookup_iters // 10))
        print(f"  lookups: done in {time.perf_counter() - t0:.1f}s", flush=True)
        daemon_cpu = daemon.cpu_seconds()
        rc = daemon.stop()

    rows: list[Row] = []
    for nprocs, s in results.items():
        rows += data_rows(nprocs, s, args.chunk_mib)
    rows += lookup_rows(lookups)
    errors = [f"{n} proc(s): {e}" for n, s in results.items() for e in s["errors"]]

    print()
    print_table(
        rows,
        title="results (GiB/s rows: value = best repeat, median = median repeat; ms rows: percentiles over all calls)",
    )
    print_breakdown(results)
    load_end = load_average()
    limits = ", ".join(
        f"one memcpy {s['phases']['memcpy']['best_gib_s']:.2f} GiB/s with {n} process{'es' if n > 1 else ''}"
        for n, s in results.items()
    )
    print(
        f"\nphysical limits on this machine (the baselines above): {limits} (every data row copies the same "
        f"bytes once); an empty gRPC round trip {lookups['empty_rtt']['p50_ms']:.3f} ms p50 (the raw transport "
        f"under every lookup); load average {load_start:.2f} at start, {load_end:.2f} at end"
    )
    if max(load_start, load_end) > 1.0:
        print(
            f"\nWARNING: load average {load_start:.2f} at start, {load_end:.2f} at end: other processes were "
            f"competing for the {info['cpus']} CPUs; GiB/s and latencies are noisy (best-of helps, ratios less so)."
        )
    misses = [r.name for r in rows if r.status == "MISS"]
    print(
        f"\n{sum(r.status == 'PASS' for r in rows)} PASS, {len(misses)} MISS; daemon exit code {rc}, "
        f"daemon CPU {daemon_cpu:.1f}s; total {time.perf_counter() - t_start:.1f}s"
    )
    if errors:
        print("ERRORS (results above are not valid):")
        for e in errors:
            print("  " + e)

    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "local_path",
                "config": {
                    "working_set_bytes": working_set,
                    "chunk_bytes": chunk,
                    "chunks": chunks,
                    "batch": args.batch,
                    "repeat": args.repeat,
                    "warmup": args.warmup,
                    "procs": procs,
                    "lookup_iters": args.lookup_iters,
                    "cpu_bytes": cpu_bytes,
                    "two_proc_split": "each process moves half the working set",
                    "gib_s_value": "best repeat",
                    "targets": {"pool": POOL_TARGET, "region": REGION_TARGET, "lookup_256_p50": LOOKUP_TARGET},
                },
                "machine": info,
                "rows": [r.to_json() for r in rows],
                "data_path": {str(k): v for k, v in results.items()},
                "lookups": lookups,
                "errors": errors,
                "load_average": {"start": load_start, "end": load_end},
                "daemon": {"exit_code": rc, "cpu_s": daemon_cpu},
                "elapsed_s": time.perf_counter() - t_start,
            },
        )
        print(f"JSON written to {args.json}")
    return 1 if errors or rc not in (0, None) else 0
