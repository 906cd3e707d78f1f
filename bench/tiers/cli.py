# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The tiers benchmark's command line: `python -m bench.tiers`."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lib.buffers import fill_pattern
from bench.lib.report import GIB, MIB, load_average, machine_info, write_json
from bench.tiers import __doc__ as DOC
from bench.tiers.common import PAGE, Pair, Pool, describe, print_pairs, say
from bench.tiers.fs import bench_fs
from bench.tiers.s3 import bench_s3


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.tiers", description=(DOC or "").split("\n\n")[0])
    ap.add_argument("--fs-gib", type=float, default=1.0, help="bytes per fs phase (default 1 GiB)")
    ap.add_argument("--s3-mib", type=float, default=256, help="bytes per S3 phase (default 256 MiB)")
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fs", choices=("on", "off"), default="on")
    ap.add_argument("--s3", choices=("rgw", "moto", "off"), default="rgw")
    ap.add_argument("--fs-threads", type=int, default=8, help="fs tier io_threads = raw threads (daemon: 8)")
    ap.add_argument("--fs-inflight", type=int, default=16, help="fs tier operations in flight (daemon: 16)")
    ap.add_argument("--s3-inflight", type=int, default=16, help="S3 requests in flight, tier and raw (daemon: 16)")
    ap.add_argument("--s3-timeout", type=float, default=5.0, help="S3 per-operation timeout (daemon: 5 s)")
    ap.add_argument("--drop", type=int, choices=(1, 3), default=3, help="drop_caches level before fs loads")
    ap.add_argument("--writeback", choices=("on", "off"), default="on", help="the write-back stream row")
    ap.add_argument("--wb-ram-mib", type=int, default=256, help="the write-back daemon's RAM (default 256 MiB)")
    ap.add_argument("--wb-streams", type=int, default=2, help="clients storing at once (default 2)")
    ap.add_argument("--wb-batch", type=int, default=16, help="chunks per store RPC (default 16, as the vLLM tier)")
    ap.add_argument("--fresh-root", action="store_true", help="fs roots without their fan-out directories")
    ap.add_argument("--memstore-bytes", type=int, default=2 * GIB, help="radosgw memstore OSD size")
    ap.add_argument("--dir", type=Path, default=None, help="parent of the fs roots (default: the temp dir)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    args.chunk_bytes = int(args.chunk_mib * MIB)
    if args.chunk_bytes % PAGE or args.chunk_bytes <= 0:
        ap.error("--chunk-mib must give a whole number of pages")
    args.fs_chunks = max(1, int(args.fs_gib * GIB) // args.chunk_bytes) if args.fs == "on" else 0
    args.s3_chunks = max(1, int(args.s3_mib * MIB) // args.chunk_bytes) if args.s3 != "off" else 0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    import uvloop

    t_start = time.perf_counter()
    say(
        f"kvstored tiers benchmark: {args.chunk_bytes / MIB:g} MiB chunks, {args.rounds} rounds (median), "
        f"fs {args.fs_chunks} chunks/phase ({args.fs_threads} I/O threads, {args.fs_inflight} in flight, "
        f"drop_caches {args.drop}, {'fresh' if args.fresh_root else 'in-use'} roots), "
        f"s3 {args.s3_chunks} chunks/phase ({args.s3_inflight} in flight, {args.s3})"
    )
    load0 = load_average()
    high = "  (HIGH: expect noise)" if load0 > (os.cpu_count() or 1) * 0.5 else ""
    say(f"  load average {load0:.2f} on {os.cpu_count()} CPUs{high}")
    pool_chunks = max(args.fs_chunks, args.s3_chunks, 1)
    src, dst = Pool(pool_chunks, args.chunk_bytes), Pool(pool_chunks, args.chunk_bytes)
    fill_pattern(src.array, args.chunk_bytes, seed=7)
    pairs: list[Pair] = []
    notes: list[str] = []
    failures: list[str] = []
    result: dict[str, Any] = {"machine": machine_info(), "load_average_start": load0, "args": vars(args)}
    workdir = Path(tempfile.mkdtemp(prefix="kvstored-bench-tiers-", dir=args.dir))
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            parts = [("fs", lambda: bench_fs(runner, args, src, dst, workdir, notes))] if args.fs == "on" else []
            parts += [("s3", lambda: bench_s3(runner, args, src, dst, notes))] if args.s3 != "off" else []
            for name, part in parts:
                try:
                    part_pairs, result[name] = part()
                    pairs += part_pairs
                except Exception as exc:  # noqa: BLE001 - reported; the other part still runs
                    failures.append(f"{name}: ABORTED: {describe(exc)}")
                    say(f"  {failures[-1]}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    targeted = [p for p in pairs if p.target is not None]
    say("")
    print_pairs(targeted + [p for p in pairs if p.target is None])
    for note in notes + failures:
        say(f"  * {note}")
    elapsed = time.perf_counter() - t_start
    say(f"\nload average {load0:.2f} at start, {load_average():.2f} at end; total {elapsed:.0f} s")
    result.update(rows=[p.to_json() for p in pairs], notes=notes, failures=failures, elapsed_s=elapsed)
    if args.json:
        write_json(args.json, result)
        say(f"results written to {args.json}")
    if failures:
        return 2
    return 0 if all(p.status == "PASS" for p in targeted) else 1
