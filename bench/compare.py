# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstored beside the real peers, interleaved in one run, on the same 2 MiB chunks (not a test):
kvstored (a real daemon, the client's default path), Mooncake Store (standalone per-node client
with zero-copy dummy clients, and embedded), LMCache's MP server, Redis 7 and a raw memcpy. Each
peer runs from a venv of its own that the bench makes under .venv/peers/; one that fails to
install or start is reported with why.

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.lib.daemons import REPO, cpu_of
from bench.lib.limits import GIB, MIB, apply_nt_threshold, nt_threshold_arg
from bench.lib.report import Row, aggregate_gib_s, load_average, machine_info, print_aligned, print_table, write_json
from bench.peers import lmcache, local, mooncake
from bench.peers.worker import Server

TARGET_VS_REDIS = 5.0
LOOKUP_KEYS = 256
# name, label, whether it runs at every process count (else at most --peer-procs), start(workdir, capacity)
SYSTEMS: list[tuple[str, str, bool, Callable[[Path, int], Server]]] = [
    ("kvstored", "kvstored", True, local.start_kvstored),
    ("mooncake", "Mooncake (standalone client)", False, partial(mooncake.start, standalone=True)),
    ("mooncake-embedded", "Mooncake (embedded)", False, partial(mooncake.start, standalone=False)),
    ("lmcache", "LMCache MP server", False, lmcache.start),
    ("redis", "Redis 7", False, local.start_redis),
    ("memcpy", "memcpy", True, local.start_memcpy),
]

Results = dict[tuple[str, int, str], list[float]]  # (system, processes, metric) -> one value per round


class WorkerProcess:
    """One client process; call() sends a command and waits for its answer."""

    def __init__(self, system: str, server: Server, cfg: dict[str, Any], log_dir: Path) -> None:
        python = str(server.python or sys.executable)
        # the repository first (bench.peers.worker), then what the caller had: a worktree's client on it must win
        # over an editable install of another checkout's
        path = [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
        self.log_path = Path(tempfile.mkstemp(prefix=f"worker-{system}-", suffix=".log", dir=log_dir)[1])
        self.proc = subprocess.Popen(
            [python, "-m", "bench.peers.worker", system, json.dumps({**server.config, **cfg})],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log_path, "wb"),
            text=True,
            env={**os.environ, **server.env, "PYTHONPATH": os.pathsep.join(path)},
        )
        self.read()  # the driver is up
        self.pid = self.proc.pid

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"client process exited ({self.proc.returncode}): {self.log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error", "?"))
        return reply

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.read()

    def log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return " | ".join(ln for ln in lines[-4:] if ln.strip())[-400:]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("quit")
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_path.unlink(missing_ok=True)


@dataclass
class System:
    """A system in the comparison, started or failed (`error` says why)."""

    name: str
    label: str
    procs: list[int]  # the numbers of client processes it runs at
    server: Server | None = None
    error: str = ""
    workers: list[WorkerProcess] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, label: str, procs: list[int], starter: Callable[[], Server]) -> System:
        sys_ = cls(name, label, procs)
        try:
            sys_.server = starter()
            print(f"  {label}: {sys_.server.describe}", flush=True)
        except Exception as exc:
            sys_.error = f"did not install or start: {type(exc).__name__}: {exc}"
            print(f"  {label}: {sys_.error}", flush=True)
        return sys_

    @property
    def ok(self) -> bool:
        return self.server is not None and not self.error

    def clients(self, n: int, cfg: dict[str, Any], log_dir: Path) -> list[WorkerProcess]:
        assert self.server is not None
        while len(self.workers) < n:
            self.workers.append(WorkerProcess(self.name, self.server, cfg, log_dir))
        return self.workers[:n]

    def cpu_seconds(self, clients: list[WorkerProcess]) -> tuple[float, float]:
        """(client processes', server processes') CPU seconds so far."""
        assert self.server is not None
        return cpu_of([w.pid for w in clients]), cpu_of(self.server.pids())

    def fail(self, exc: BaseException) -> None:
        self.error = f"failed while measuring: {type(exc).__name__}: {exc}"
        print(f"  {self.label}: {self.error}", flush=True)
        self.close()

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers.clear()
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.stop()
            self.server = None


def _all(clients: list[WorkerProcess], op: str, kwargs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same command to every client process at once (kwargs[i] to the i-th); their answers."""
    for w, kw in zip(clients, kwargs):
        w.send(op, **kw)
    return [w.read() for w in clients]


def measure(
    s: System, p: int, rnd: int, args: argparse.Namespace, chunk: int, log_dir: Path, res: Results, iters: int
) -> None:
    clients = s.clients(p, {"chunk": chunk, "slots": args.batch}, log_dir)
    tag = f"r{rnd}p{p}"
    n = args.batch
    clients[0].call("clear")

    def put(metric: str, value: float) -> None:
        res.setdefault((s.name, p, metric), []).append(value)

    # 64-chunk batches, all processes at once, each under keys of its own
    own: list[dict[str, Any]] = [{"tag": f"{tag}w{i}", "n": n} for i in range(p)]
    cpu, wall = [0.0, 0.0], 0.0
    for prep, op, metric in (("fill", "batch_store", "store_gib_s"), ("zero", "batch_load", "load_gib_s")):
        _all(clients, prep, [{"n": n}] * p)
        c0, s0, t0 = *s.cpu_seconds(clients), time.perf_counter()
        replies = _all(clients, op, own)
        c1, s1 = s.cpu_seconds(clients)
        wall += time.perf_counter() - t0
        cpu[0], cpu[1] = cpu[0] + c1 - c0, cpu[1] + s1 - s0
        put(metric, aggregate_gib_s(p * n * chunk, [(r["t0"], r["t1"]) for r in replies]))
    _all(clients, "verify", [{"n": n}] * p)
    moved = 2 * p * n * chunk / GIB
    put("client_cpu_s_gib", cpu[0] / moved)
    put("server_cpu_s_gib", cpu[1] / moved)
    put("cpus_busy", (cpu[0] + cpu[1]) / wall)
    _all(clients, "remove", own)

    # one call at a time in each process, all processes at once
    for op, metric in (("lat_store", "store1_ms"), ("lat_load", "load1_ms"), ("lat_lookup", "lookup_ms")):
        kwargs: list[dict[str, Any]] = [{"tag": f"{tag}{op}{i}", "iters": iters} for i in range(p)]
        if op == "lat_lookup":
            if s.name == "memcpy":
                continue
            clients[0].call("clear")
            clients[0].call("prepare_lookup", tag=f"{tag}lk", keys=LOOKUP_KEYS)
            kwargs = [{"tag": f"{tag}lk", "iters": iters, "keys": LOOKUP_KEYS}] * p
        _, sc0 = s.cpu_seconds(clients)
        replies = _all(clients, op, kwargs)
        _, sc1 = s.cpu_seconds(clients)
        lat = [x for r in replies for x in r["lat"]]
        put(metric, statistics.median(lat) * 1e3)
        put(metric.replace("_ms", "_server_cpu_ms"), (sc1 - sc0) / len(lat) * 1e3)
        if op == "lat_lookup":
            clients[0].call("remove", tag=f"{tag}lk", n=LOOKUP_KEYS)


def _range(v: list[float] | None, fmt: str = ".2f") -> str:
    if not v:
        return "-"
    med = statistics.median(v)
    return f"{med:{fmt}}" if len(v) == 1 else f"{med:{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"


def report(systems: list[System], res: Results, cpus: int) -> list[Row]:
    cols = [
        ("store_gib_s", "store64 GiB/s", ".2f"),
        ("load_gib_s", "load64 GiB/s", ".2f"),
        ("store1_ms", "store1 p50 ms", ".3f"),
        ("load1_ms", "load1 p50 ms", ".3f"),
        ("lookup_ms", f"lookup{LOOKUP_KEYS} p50 ms", ".3f"),
        ("client_cpu_s_gib", "client CPU s/GiB", ".3f"),
        ("server_cpu_s_gib", "server CPU s/GiB", ".3f"),
        ("store1_server_cpu_ms", "server CPU ms/store1", ".3f"),
        ("load1_server_cpu_ms", "ms/load1", ".3f"),
        ("lookup_server_cpu_ms", "ms/lookup", ".3f"),
        ("cpus_busy", f"CPUs busy (of {cpus})", ".2f"),
    ]
    table = [["system", "procs", *(c[1] for c in cols)]]
    for s in systems:
        if s.error and not any(k[0] == s.name for k in res):
            table.append([s.label, "-", s.error[:120], *[""] * (len(cols) - 1)])
            continue
        for p in s.procs:
            table.append([s.label, str(p), *(_range(res.get((s.name, p, c[0])), c[2]) for c in cols)])
    print("median over rounds (min-max); p50s pool the calls of every process in a round")
    print_aligned(table, right=set(range(1, len(cols) + 2)))
    for s in systems:
        if s.error and any(k[0] == s.name for k in res):
            print(f"  * {s.label}: {s.error}")

    med = {key: statistics.median(v) for key, v in res.items() if v}
    busy = {(s.label, p): med.get((s.name, p, "cpus_busy"), 0.0) for s in systems for p in s.procs}
    if over := [f"{label} x{p} ({b:.2f})" for (label, p), b in busy.items() if b >= 0.85 * cpus]:
        print(f"  * CPU-bound (>= 85% of the {cpus} CPUs busy in the 64-chunk phases): " + ", ".join(over))

    rows: list[Row] = []
    for metric, what, p in (
        ("store1_ms", "1-chunk store p50", 1),
        ("load1_ms", "1-chunk load p50", 1),
        ("lookup_ms", f"{LOOKUP_KEYS}-key lookup p50 (Mooncake: batch_is_exist)", 1),
        ("store_gib_s", "64-chunk store, 1 process", 1),
        ("load_gib_s", "64-chunk load, 1 process", 1),
        ("store_gib_s", "64-chunk store, 2 processes", 2),
        ("load_gib_s", "64-chunk load, 2 processes", 2),
    ):
        kv = med.get(("kvstored", p, metric))
        for peer in ("mooncake", "mooncake-embedded"):
            base = med.get((peer, p, metric))
            if kv is None or base is None:
                continue
            label = next(s.label for s in systems if s.name == peer)
            unit, higher = ("ms", False) if metric.endswith("_ms") else ("GiB/s", True)
            rows.append(Row(f"kvstored {what}", kv, unit, label, base, target=1.0, higher_is_better=higher))
    kv, redis = med.get(("kvstored", 1, "load_gib_s")), med.get(("redis", 1, "load_gib_s"))
    if kv is not None and redis is not None:
        rows.append(Row("kvstored 64-chunk load", kv, "GiB/s", "Redis 7 GET pipelined 16", redis, TARGET_VS_REDIS))
    print()
    print_table(rows, title="targets (issue 23): same-run medians over rounds, 1 process unless said")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every system (default 3)")
    ap.add_argument("--iters", type=int, default=100, help="calls per latency measurement per process (default 100)")
    ap.add_argument("--batch", type=int, default=64, help="chunks per batch store/load (default 64)")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="chunk size in MiB (default 2; LMCache needs 2)")
    ap.add_argument("--procs", default="1,2,4", help="client processes for kvstored and memcpy (default 1,2,4)")
    ap.add_argument("--peer-procs", default="1,2", help="client processes for the peers (default 1,2)")
    ap.add_argument("--systems", default=",".join(s[0] for s in SYSTEMS), help="which systems (default: all of them)")
    ap.add_argument("--workdir", default=str(REPO / "results" / "tmp"), help="servers' directories and logs")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    nt_threshold_arg(ap)
    args = ap.parse_args(argv)
    apply_nt_threshold(args.nt_threshold)
    chunk = int(args.chunk_mib * MIB)
    every, peer = [int(x) for x in args.procs.split(",")], [int(x) for x in args.peer_procs.split(",")]
    wanted = args.systems.split(",")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="compare-", dir=workdir))
    info = machine_info()
    print(
        f"kvstored beside the peers -- {chunk / MIB:g} MiB chunks, batches of {args.batch}, {args.rounds} rounds, "
        f"{args.iters} calls per latency measurement per process; {info['cpu_model']}, {info['cpus']} CPUs, "
        f"{info['mem_total_gib']} GiB, git {info['git']}, load average {load_average():.2f}",
        flush=True,
    )
    systems: list[System] = []
    res: Results = {}
    t_all = time.perf_counter()
    try:
        for name, label, all_procs, start in SYSTEMS:
            if name not in wanted:
                continue
            procs = every if all_procs else peer
            capacity = max(procs) * args.batch * chunk + LOOKUP_KEYS * chunk + 128 * MIB
            if name == "kvstored":
                capacity = int(capacity * 1.25)
            systems.append(System.start(name, label, procs, partial(start, workdir, capacity)))
        # round -1 warms every system up (fresh pages of servers and clients, connections) and is dropped
        for rnd in range(-1, args.rounds):
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for s in order:
                if not s.ok:
                    continue
                try:
                    for p in s.procs:
                        measure(s, p, rnd, args, chunk, log_dir, res if rnd >= 0 else {}, args.iters if rnd >= 0 else 5)
                except Exception as exc:
                    tail = " | ".join(w.log_tail() for w in s.workers[:1])
                    s.fail(RuntimeError(f"{exc}{' (client log: ' + tail + ')' if tail else ''}"))
            done = [f"{s.label} {statistics.median(v):.3f}" for s in systems if (v := res.get((s.name, 1, "load1_ms")))]
            print(f"  round {rnd + 1}/{args.rounds} done (0: warm-up): load1 p50 ms " + ", ".join(done), flush=True)
    finally:
        for s in systems:
            with contextlib.suppress(Exception):
                s.close()
        with contextlib.suppress(OSError):
            log_dir.rmdir()
    print()
    rows = report(systems, res, info["cpus"] or 1)
    print(f"\ntook {time.perf_counter() - t_all:.0f} s; load average now {load_average():.2f}")
    if args.json:
        command = " ".join([Path(sys.executable).name, "-m", "bench.compare", *(argv or sys.argv[1:])])
        doc = {"benchmark": "compare", "command": command, "machine": info, "chunk_bytes": chunk, "batch": args.batch}
        doc |= {"rounds": args.rounds, "iters": args.iters}
        doc["systems"] = {s.name: {"label": s.label, "error": s.error} for s in systems}
        doc["results"] = [
            {"system": k[0], "procs": k[1], "metric": k[2], "per_round": v} for k, v in sorted(res.items())
        ]
        write_json(args.json, doc | {"targets": [r.to_json() for r in rows]})
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
