# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer benchmark's rounds, rows and command line: `python -m bench.peer`."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np

from bench.lib.buffers import populate
from bench.lib.report import GIB, MIB, Row, load_average, machine_info, print_table, write_json
from bench.lib.s3 import start_s3
from bench.peer import __doc__ as DOC
from bench.peer.cluster import RAW, Cluster, ColdTier, Link, odirect, raw, raw_s3
from bench.peer.loads import COPIED, FS_THREADS, S3_INFLIGHT, TARGET, Chunks, Measured


def rounds(
    arms: dict[str, Callable[[], Measured]], count: int, samples: dict[str, list[Measured]], failures: list[str]
) -> None:
    """Every arm once per round, in a rotating order; an arm that fails is dropped (reported)."""
    names = list(arms)
    for r in range(count):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name not in arms:
                continue
            try:
                m = arms[name]()
            except Exception as exc:  # noqa: BLE001 - reported; the other arms go on
                failures.append(f"{name}: {exc}")
                del arms[name]
                continue
            samples.setdefault(name, []).append(m)
            cpu = " ".join(f"{side} {v:.2f}" for side, v in zip(("fetching", "serving"), m.cpu_s_per_gib) if v == v)
            cpu = f", CPU s/GiB {cpu}" if cpu else ""
            print(f"round {r}: {name}: {m.gib_s:.2f} GiB/s{cpu}; load average {load_average():.2f}", file=sys.stderr)


def part(name: str, failures: list[str], body: Callable[[], None]) -> None:
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - reported; the other parts still run
        failures.append(f"{name}: {exc}")


def run(args: argparse.Namespace, notes: list[str], failures: list[str]) -> dict[str, list[Measured]]:
    chunks = Chunks(int(args.gib * GIB) // (args.chunk_mib * MIB), args.chunk_mib * MIB)
    out = populate(np.empty((chunks.n, chunks.size), np.uint8))
    samples: dict[str, list[Measured]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="kvstored-bench-peer-", dir=args.dir))

    def peers() -> None:
        transports = args.transports.split(",")
        cluster = Cluster(transports, chunks)
        try:
            cluster.start()
            arms: dict[str, Callable[[], Measured]] = {}
            for t in transports:
                arms[f"peer tier over {t}"] = partial(cluster.measure, t, out, args.batch, args.clients, False)
                arms[f"{COPIED} over {t}"] = partial(cluster.measure, t, out, args.batch, args.clients, True)
                arms[f"raw {t}"] = partial(raw, t, chunks, slots=args.batch * args.clients)
            rounds(arms, args.rounds, samples, failures)
        finally:
            cluster.stop()

    def fs() -> None:
        cold = ColdTier(f"kind=fs,root={workdir / 'fs'},bytes={4 * chunks.nbytes}", chunks, "bench/peer-fs")
        cold.prepare()
        arms = {
            "fs tier, cold": lambda: cold.measure(out, args.batch, args.clients, drop=True),
            "raw O_DIRECT read": lambda: odirect(workdir, chunks),
        }
        rounds(arms, args.rounds, samples, failures)

    def s3() -> None:
        server = start_s3(args.s3, memstore_bytes=2 * chunks.nbytes + GIB)
        try:
            if server.note:
                notes.append(server.note)
            ep, bucket = server.endpoint, server.new_bucket(f"kvstored-bench-peer-{os.getpid()}")
            cold = ColdTier(server.tier_spec(bucket, 0), chunks, "bench/peer-s3")
            cold.prepare()
            arms = {
                f"S3 tier ({server.kind})": lambda: cold.measure(out, args.batch, args.clients, drop=False),
                "raw S3 GET": lambda: raw_s3(ep, bucket),
            }
            rounds(arms, args.rounds, samples, failures)
        finally:
            server.stop()

    def link(mtu: int) -> None:
        options = {"streams": str(args.streams)} if args.streams else {}
        if args.data_threads:
            options["data_threads"] = args.data_threads
        link = Link(args.transports.split(","), chunks, mtu, options)
        try:
            link.start()
            arms: dict[str, Callable[[], Measured]] = {}
            for t in link.transports:
                arms[f"peer tier over {t}, MTU {mtu}"] = partial(link.measure, t, out, args.batch, args.clients)
            for arm in RAW:
                arms[f"{arm}, MTU {mtu}"] = partial(link.raw, arm, args.batch * args.clients)
            rounds(arms, args.rounds, samples, failures)
        finally:
            link.stop()

    try:
        if args.netns:
            for mtu in args.mtu:
                part(f"link, MTU {mtu}", failures, partial(link, mtu))
            return samples
        part("peer", failures, peers)
        if args.fs == "on":
            part("fs", failures, fs)
        if args.s3 != "off":
            part("s3", failures, s3)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return samples


def _median(samples: dict[str, list[Measured]], name: str) -> float | None:
    return statistics.median(m.gib_s for m in samples[name]) if name in samples else None


def _row(samples: dict[str, list[Measured]], name: str, base: str, target: float | None, limit: str, vs: str) -> Row:
    """`name`'s row against `base`, with `vs` beside it round by round in its note."""
    value = _median(samples, name) or 0.0
    note = _note(samples, name, vs)
    return Row(name, value, "GiB/s", base, _median(samples, base), target, median=value, limit=limit, note=note)


def rows(samples: dict[str, list[Measured]]) -> list[Row]:
    out: list[Row] = []
    for prefix, target in (("peer tier", TARGET), (COPIED, None)):  # the targeted rows first
        for name in (n for n in samples if n.startswith(prefix)):
            raw = f"raw {name.rsplit(' ', 1)[1]}"
            out.append(_row(samples, name, raw, target, f"{raw} on loopback (the kernel's copies; same run)", raw))
    peer = next((r.name for r in out if r.name == "peer tier over tcp"), out[0].name if out else "")
    for name in (n for n in samples if n.startswith(("fs", "S3"))):
        fs = name.startswith("fs")
        limit = "raw O_DIRECT read" if fs else "raw S3 GET"
        depth = f"{FS_THREADS} threads" if fs else f"the tier's objects, {S3_INFLIGHT} in flight"
        lim = _median(samples, limit)
        bound = f"{limit}, {depth}: " + (f"{lim:.2f} GiB/s" if lim else "not measured")
        out.append(_row(samples, name, peer, None, bound, limit))
    return out


def link_rows(samples: dict[str, list[Measured]], mtus: Sequence[int]) -> list[Row]:
    """Per MTU: the peer tier's rows and the raw transports', each against the best raw transport
    of that MTU (the highest median) in the same run."""
    out: list[Row] = []
    for mtu in mtus:
        suffix = f", MTU {mtu}"
        raws = [f"{arm}{suffix}" for arm in RAW if f"{arm}{suffix}" in samples]
        best = max(raws, key=lambda name: _median(samples, name) or 0.0) if raws else ""
        peers = [n for n in samples if n.startswith("peer tier") and n.endswith(suffix)]
        for name in peers + raws:
            limit = f"the best raw transport on that link: {best}" if name in peers else ""
            vs = best if best and name != best else name
            out.append(_row(samples, name, best, TARGET if name in peers else None, limit, vs))
    return out


def _note(samples: dict[str, list[Measured]], name: str, base: str) -> str:
    def per_round(k: str) -> str:
        return ", ".join(f"{m.gib_s:.2f}" for m in samples.get(k, []))

    def cpu(k: str) -> str:
        ms = samples.get(k, [])
        if not ms:
            return "-"
        text = "+".join(f"{statistics.median(m.cpu_s_per_gib[i] for m in ms):.2f}" for i in (0, 1))
        client = statistics.median(m.client_cpu_s_per_gib for m in ms)
        return text + (f" (clients {client:.2f})" if client == client else "")

    paired = ", ".join(f"{a.gib_s / b.gib_s:.2f}" for a, b in zip(samples.get(name, []), samples.get(base, [])))
    return (
        f"GiB/s per round: {name} {per_round(name)}; {base} {per_round(base)} (paired ratios {paired}); "
        f"CPU s/GiB fetching+serving: {name} {cpu(name)}, {base} {cpu(base)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.peer",
        description=(DOC or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(DOC or "").split("\n\n", 1)[1],
    )
    p.add_argument("--gib", type=float, default=1.0, help="bytes each arm moves (default 1 GiB)")
    p.add_argument("--chunk-mib", type=int, default=2, help="chunk size (default 2 MiB)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each arm once per round (default 3)")
    p.add_argument("--transports", default="tcp,ucx", help="peer tier transports (default tcp,ucx)")
    p.add_argument("--batch", type=int, default=32, help="chunks per load call (default 32)")
    p.add_argument("--clients", type=int, default=2, help="clients loading at once (default 2)")
    p.add_argument("--fs", choices=("on", "off"), default="on", help="the cold fs tier row")
    p.add_argument(
        "--s3", choices=("rgw", "moto", "off"), default="rgw", help="the S3 row's server (rgw: moto if none)"
    )
    p.add_argument("--dir", default=None, help="where the fs tier and raw O_DIRECT files go (default: temp dir)")
    p.add_argument("--netns", action="store_true", help="across a veth pair between two network namespaces (root)")
    p.add_argument("--mtu", default="1500,9000", help="--netns: the link's MTUs, one set of rows each")
    p.add_argument("--streams", type=int, default=0, help="--netns: the peer tier's streams (default: the daemon's)")
    p.add_argument("--data-threads", choices=("auto", "on", "off"), help="--netns: the peer tier's data_threads")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    args.mtu = [int(m) for m in args.mtu.split(",")]
    load0 = load_average()
    print(
        f"peer tier benchmark: {args.gib:g} GiB of {args.chunk_mib} MiB chunks, {args.rounds} rounds (median); "
        f"load average {load0:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    notes: list[str] = []
    failures: list[str] = []
    t0 = time.perf_counter()
    samples = run(args, notes, failures)
    table = link_rows(samples, args.mtu) if args.netns else rows(samples)
    load1 = load_average()
    basis = (
        "the best raw transport at that MTU" if args.netns else "the raw transport; fs and S3: the peer tier over tcp"
    )
    title = f"\nB loading what only A holds ({args.clients} clients, {args.batch} chunks per call) vs {basis}"
    print_table(table, title=title)
    for line in notes + failures:
        print(f"  * {line}")
    print(f"\nload average {load0:.2f} at start, {load1:.2f} at end; total {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(
            args.json,
            {
                "bench": "peer",
                "machine": machine_info(),
                "args": vars(args),
                "load_average": {"start": load0, "end": load1},
                "rows": [r.to_json() for r in table],
                "samples": {k: [asdict(m) for m in v] for k, v in samples.items()},
                "notes": notes,
                "failures": failures,
            },
        )
    if failures:
        return 2
    return 0 if all(r.status == "PASS" for r in table if r.target is not None) else 1
