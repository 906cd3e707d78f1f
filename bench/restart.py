# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A restart with a full RAM tier: the hand-over against a cold restart in one run; time to serving and to all RAM
hits, bytes verified byte-exact, the ratio cold / hand-over, where the hand-over's time goes. Target: serving in
<= 2 s with a full 16 GiB pool (this machine runs 8 GiB).

Not a test. A real daemon's RAM tier is filled with 2 MiB chunks (an xxh3-64 of each kept), then restarted on
the same socket: hand-overs (the new daemon adopts the running one's pool), then a cold restart (SIGTERM, then
the same start). Method and results: docs/benchmarks.md#restarting-with-a-full-ram-tier.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from bench.lib.daemons import Daemon
from bench.lib.report import GIB, fmt_bytes, load_average, machine_info, print_aligned, write_json
from kvstored.shm.memory import meminfo
from kvstored.sizes import parse_size
from kvstored_client import Client, NamespaceSpec, Tier
from tests.support.daemon import short_tmpdir
from tests.support.data import make_keys
from tests.support.wait import wait_for

TARGET_S, TARGET_GIB = 2.0, 16
BATCH = 64  # chunks per store/load call (128 MiB of 2 MiB chunks)
# Log lines that mark the hand-over's steps: (step, daemon, message prefix).
MARKS = [
    ("requested", "old", "hand-over requested by a new daemon"),
    ("quiesced", "old", "hand-over: stopping to hand the RAM tier over"),
    ("sent", "old", "RAM tier handed over:"),
    ("exited", "old", "stopped"),
    ("asked", "new", "hand-over: asked the running daemon"),
    ("received", "new", "RAM tier handed over by"),
    ("populated", "new", "RAM tier populated"),
    ("adopted", "new", "RAM tier adopted"),
    ("serving", "new", "serving on"),
    ("swept", "new", "every adopted chunk verified"),
]
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+\s+\S+: (.*)$")


@dataclass
class Restart:
    kind: str
    serving_s: float  # from the new process's start
    unserved_s: float  # from the old daemon's last answer (its stop for the hand-over, or SIGTERM)
    all_ram_hits_s: float | None  # None: never (a cold RAM tier)
    ram_hits: int
    other_hits: int  # hits below RAM (an fs tier)
    chunks: int
    bytes_verified: int
    wrong_chunks: int
    old_stop_s: float = 0.0  # SIGTERM to exit (cold only: in a hand-over the old one stops by itself)
    extra_shmem_bytes: int = 0  # peak shared memory during the restart, over what it was before
    steps_s: dict[str, float] = field(default_factory=dict)
    load_average: float = 0.0  # at the restart's start (other work on the machine slows it)
    same_pool: bool = False  # the new daemon's pool is the old one's memfd (not a second pool)


def pool_inodes(pid: int) -> set[int]:
    """The pool memfds `pid` holds, by inode."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # (closed while listed: the daemon's own fds come and go)
            if os.readlink(fd).startswith("/memfd:kvstored-pool"):
                inodes.add(fd.stat().st_ino)
    return inodes


class PeakShmem(threading.Thread):
    """The most shared memory (Shmem in /proc/meminfo) seen in the block, sampled every 10 ms."""

    def __init__(self) -> None:
        super().__init__(name="shmem-sampler")
        self.peak = meminfo()["Shmem"]
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, meminfo()["Shmem"])

    def __enter__(self) -> PeakShmem:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.join()


def fill(kv: Client, ns: Any, keys: list[bytes], chunk_bytes: int) -> list[int]:
    """Store a chunk under each key (a random block plus the chunk's number: each one distinct); their digests."""
    base = np.random.default_rng(25).integers(0, 2**63, chunk_bytes // 8, dtype=np.uint64)
    digests = []
    for first in range(0, len(keys), BATCH):
        numbers = np.arange(first, min(first + BATCH, len(keys)), dtype=np.uint64)
        data = (base[None, :] + numbers[:, None]).view(np.uint8)
        kv.store(ns, keys[first : first + len(data)], data)
        digests += [xxhash.xxh3_64_intdigest(row) for row in data]
    return digests


def tiers_of(kv: Client, ns: Any, keys: list[bytes]) -> list[Tier]:
    return [t for i in range(0, len(keys), 1024) for t in kv.lookup(ns, keys[i : i + 1024]).tiers]


def verify(kv: Client, ns: Any, keys: list[bytes], digests: list[int], chunk_bytes: int) -> tuple[int, int]:
    """Load every chunk that is a hit; (bytes that match their digest, chunks that do not)."""
    out = np.empty((BATCH, chunk_bytes), dtype=np.uint8)
    good = wrong = 0
    hits = [i for i, t in enumerate(tiers_of(kv, ns, keys)) if t is not Tier.NONE]
    for i in hits:  # one at a time: a batch load stops at its first miss
        if kv.load(ns, [keys[i]], out[:1]) != 1:
            continue
        if xxhash.xxh3_64_intdigest(out[0]) == digests[i]:
            good += chunk_bytes
        else:
            wrong += 1
    return good, wrong


def restart(
    kind: str, old: Daemon, new: Daemon, ns_spec: NamespaceSpec, keys: list[bytes], digests: list[int], chunk_bytes: int
) -> Restart:
    old_stop_s, shmem_before, load, old_pool = 0.0, meminfo()["Shmem"], load_average(), pool_inodes(old.pid)
    with PeakShmem() as peak:
        if kind == "cold":
            t, unserved_from = time.perf_counter(), time.time()
            old.stop()
            old_stop_s = time.perf_counter() - t
        t0, wall0 = time.perf_counter(), time.time()
        new.spawn()
        if kind == "hand-over":
            old.wait()  # (until then the old daemon answers the health checks on the socket)
        new.wait_ready()
        serving_s = time.perf_counter() - t0
    same_pool = pool_inodes(new.pid) == old_pool
    with Client(new.socket, deadline_s=60.0) as kv:
        ns = kv.register_namespace(ns_spec)
        tiers = tiers_of(kv, ns, keys)
        all_hits_s = time.perf_counter() - t0 if all(t is Tier.RAM for t in tiers) else None
        ram = sum(t is Tier.RAM for t in tiers)
        other = sum(t not in (Tier.RAM, Tier.NONE) for t in tiers)
        good, wrong = verify(kv, ns, keys, digests, chunk_bytes)
    steps: dict[str, float] = {}
    if kind == "hand-over":
        wait_for(lambda: MARKS[-1][2] in new.log, timeout=60)  # (the daemon's sweep may still be checking chunks)
        steps = log_steps(old.log, new.log, wall0)
        # The old daemon serves until it stops for the hand-over (it hashes while serving first).
        unserved_from = wall0 + steps.get("quiesced", steps.get("requested", 0.0))
    unserved_s = wall0 + serving_s - unserved_from
    extra_shmem = peak.peak - shmem_before
    r = Restart(kind, serving_s, unserved_s, all_hits_s, ram, other, len(keys), good, wrong, old_stop_s, extra_shmem)
    r.steps_s, r.load_average, r.same_pool = steps, load, same_pool
    return r


def log_steps(old_log: str, new_log: str, wall0: float) -> dict[str, float]:
    """Seconds from the new process's start to each marked log line (the first of each)."""
    found: dict[str, float] = {}
    for who, text in (("old", old_log), ("new", new_log)):
        for line in text.splitlines():
            m = _STAMP.match(line)
            if not m:
                continue
            for step, daemon, prefix in MARKS:
                if daemon == who and step not in found and m[2].startswith(prefix):
                    found[step] = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall0
    return found


def phases(steps: dict[str, float]) -> list[tuple[str, float]]:
    """Where the hand-over's time goes, between consecutive marks (those found)."""
    spans = [
        ("new daemon starts (interpreter, imports, config)", "asked", ()),
        ("old daemon hears the request", "requested", ("asked",)),
        ("old daemon takes the chunk checksums it lacks, still serving", "quiesced", ("requested",)),
        ("old daemon stops: quiesce, snapshot, checksums, send", "sent", ("quiesced", "requested")),
        ("fds and state received, state checked", "received", ("sent",)),
        ("adopted pool mapped and populated", "populated", ("received",)),
        ("RAM index adopted", "adopted", ("populated", "received")),
        ("tiers, gRPC and session sockets up", "serving", ("adopted",)),
        ("(serving) every adopted chunk verified: first reads and the sweep", "swept", ("serving",)),
    ]
    out = []
    for name, end, starts in spans:
        start = next((steps[s] for s in starts if s in steps), None if starts else 0.0)
        if end in steps and start is not None:
            out.append((name, steps[end] - start))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-bytes", default="8GiB", help="the RAM tier (default 8GiB; the target's is 16GiB)")
    parser.add_argument("--fill", type=float, default=1.0, help="fraction of the RAM tier to fill (default 1.0)")
    parser.add_argument("--chunk-bytes", default="2MiB", help="chunk size (default 2MiB)")
    parser.add_argument("--fs-bytes", default="0", help="an fs tier of this size (default 0: RAM only)")
    parser.add_argument("--rounds", type=int, default=3, help="hand-overs, one after the other (default 3)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    cpu_bytes, chunk_bytes, fs_bytes = (parse_size(v) for v in (args.cpu_bytes, args.chunk_bytes, args.fs_bytes))
    n = int(cpu_bytes * args.fill) // chunk_bytes
    work = short_tmpdir("kvrs")
    extra = ["--tiers", f"kind=fs,root={work / 'fs'},bytes={fs_bytes}"] if fs_bytes else []
    ns_spec = NamespaceSpec(model="bench-restart", dtype="u8", chunk_bytes=chunk_bytes)
    keys = make_keys("restart", n)
    print(f"RAM tier {fmt_bytes(cpu_bytes)}, {n} chunks of {fmt_bytes(chunk_bytes)}, load {load_average():.1f}")

    results = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)

        def daemon() -> Daemon:  # (each stopped at the end, whatever happened)
            d = Daemon(cpu_bytes, log_level="info", extra_args=extra, socket=work / "kv.sock", start_timeout_s=300)
            cleanup.callback(d.stop)
            return d

        old = daemon()
        old.start()
        with Client(old.socket, deadline_s=60.0) as kv:
            ns = kv.register_namespace(ns_spec)
            t = time.perf_counter()
            digests = fill(kv, ns, keys, chunk_bytes)
            fill_s = time.perf_counter() - t
            before = tiers_of(kv, ns, keys)
        held = [i for i, tier in enumerate(before) if tier is Tier.RAM]
        keys, digests = [keys[i] for i in held], [digests[i] for i in held]  # (what RAM kept of the fill)
        print(f"filled in {fill_s:.1f} s: {len(keys)} chunks in RAM ({fmt_bytes(len(keys) * chunk_bytes)})")
        for kind in ["hand-over"] * max(1, args.rounds) + ["cold"]:
            new = daemon()
            results.append(restart(kind, old, new, ns_spec, keys, digests, chunk_bytes))
            old = new
    report(results, cpu_bytes, len(keys) * chunk_bytes)
    if args.json:
        ho = median_handover(results)
        target: dict[str, Any] = {"seconds": TARGET_S, "gib": TARGET_GIB}
        target |= {"from_start": status(ho, ho.serving_s), "unserved": status(ho, ho.unserved_s)}
        write_json(
            args.json,
            {
                "benchmark": "restart",
                "machine": machine_info(),
                "cpu_bytes": cpu_bytes,
                "chunk_bytes": chunk_bytes,
                "fs_bytes": fs_bytes,
                "chunks": len(keys),
                "results": [asdict(r) for r in results],
                "phases": phases(ho.steps_s),
                "target": target,
            },
        )
    return 0 if all(r.wrong_chunks == 0 for r in results) else 1


def median_handover(results: list[Restart]) -> Restart:
    """The hand-over of median unserved time (the rounds vary with what else the machine runs)."""
    rounds = sorted((r for r in results if r.kind == "hand-over"), key=lambda r: r.unserved_s)
    return rounds[(len(rounds) - 1) // 2]


def status(r: Restart, seconds: float) -> str:
    return "PASS" if seconds <= TARGET_S and r.ram_hits == r.chunks and r.wrong_chunks == 0 else "MISS"


def report(results: list[Restart], cpu_bytes: int, held_bytes: int) -> None:
    table = [["restart", "to serving", "unserved", "to all RAM hits", "RAM hits / chunks", "lower hits"]]
    table[0] += ["verified", "swept", "load"]
    for i, r in enumerate(results, 1):
        table.append(
            [
                f"{r.kind} {i}" if r.kind == "hand-over" else r.kind,
                f"{r.serving_s:.2f} s",
                f"{r.unserved_s:.2f} s",
                f"{r.all_ram_hits_s:.2f} s" if r.all_ram_hits_s is not None else "never",
                f"{r.ram_hits} / {r.chunks}",
                str(r.other_hits),
                f"{fmt_bytes(r.bytes_verified)}{f', {r.wrong_chunks} WRONG' if r.wrong_chunks else ''}",
                f"{r.steps_s['swept']:.2f} s" if "swept" in r.steps_s else "-",
                f"{r.load_average:.1f}",
            ]
        )
    print("columns: docs/benchmarks.md#restarting-with-a-full-ram-tier")
    print_aligned(table, right={1, 2, 3, 4, 5, 6, 7, 8})
    ho, cold = median_handover(results), results[-1]
    handovers = [r for r in results if r.kind == "hand-over"]
    print(
        f"cold / hand-over (median hand-over): to serving {cold.serving_s / ho.serving_s:.1f}x, "
        f"unserved {cold.unserved_s / ho.unserved_s:.1f}x"
    )
    print(
        f"target: serving in <= {TARGET_S:.0f} s, all byte-exact RAM hits, {TARGET_GIB} GiB pool; here "
        f"{cpu_bytes / GIB:.1f} GiB ({held_bytes / GIB:.2f} GiB held) against {TARGET_S:.0f} s as is: "
        f"from start {ho.serving_s:.2f} s {status(ho, ho.serving_s)}, unserved {ho.unserved_s:.2f} s "
        f"{status(ho, ho.unserved_s)}"
    )
    print(
        f"peak extra shared memory: hand-over {fmt_bytes(max(r.extra_shmem_bytes for r in handovers))}, cold "
        f"{fmt_bytes(cold.extra_shmem_bytes)} (a second pool: {fmt_bytes(cpu_bytes)}); pool is the old memfd: "
        f"{'yes' if all(r.same_pool for r in handovers) else 'NO'} (hand-over), "
        f"{'yes' if cold.same_pool else 'no'} (cold)"
    )
    if ho.steps_s:
        print("where the hand-over's time goes (daemons' log timestamps):")
        print_aligned([["phase", "seconds"], *[[name, f"{s:.3f}"] for name, s in phases(ho.steps_s)]], right={1})


if __name__ == "__main__":
    sys.exit(main())
