# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A stand-in for a daemon at either end of the peer data plane, run as a process by the tests and
the benchmark (in loopback or in its own network namespace):

    python -m tests.peer.node serve --transport tcp --chunks 512 ...
    python -m tests.peer.node fetch --transport tcp --data 10.213.7.1:7000 --control 10.213.7.1:7001 ...

`serve` holds `--chunks` chunks of known content in a pool (most split into two page runs, in
reverse order in memory) and serves them through a PeerServer; its control plane is JSON lines
over TCP (the daemon will use gRPC): {"op": "send", "chunks": [i, ...], "order": {...}} answers
with the receipts after the send. A chunk index outside the pool is answered "not here" (the
fetcher sees MISSING). `stats` on
stdin (or {"op": "stats"}) reports leases held (sends not settled), links, counters, quarantines;
`stop` on stdin or SIGTERM ends it.

`fetch` runs `--concurrency` workers that receive `--batch` chunks per order into a small pool of
slots (split into page runs too) and checks every received chunk against the known content, byte
for byte. Each
result is a JSON line on stdout; `stop` on stdin (or, with --once, the last chunk) ends the run
with a summary line: counts per outcome, wrong chunks, exceptions, quarantines, free slots.
Both print {"event": "ready", ...} first.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import mmap
import os
import resource
import signal
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from kvstored.peer import (
    PeerAddress,
    Receipt,
    SendOrder,
    Slot,
    Source,
    Transfer,
    TransportConfig,
    TransportKind,
    UcxConfig,
    make_link,
    make_server,
)

PAGE = 64 << 10
STAMP_EVERY = 4096  # every 4 KiB page of a chunk starts with (chunk index, page number)


def base_content(chunk_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, chunk_bytes, dtype=np.uint8)


def fill_chunk(out: np.ndarray, index: int, base: np.ndarray) -> None:
    """Chunk `index`'s bytes: the shared random base with per-page stamps, so a chunk served for
    another, or a piece landing at the wrong offset, never compares equal."""
    out[:] = base
    stamps = out.view(np.uint64)[:: STAMP_EVERY // 8]
    stamps[:] = (np.uint64(index) << np.uint64(24)) + np.arange(len(stamps), dtype=np.uint64)


CONTIGUOUS = False  # --contiguous: every chunk and slot one run (the RAM tier's usual case)


def server_runs(index: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) runs of chunk `index` within its region, in payload order: every third
    chunk is contiguous, the others are the region's tail then its head."""
    if CONTIGUOUS or index % 3 == 0:
        return [(0, chunk_bytes)]
    head = PAGE * (1 + index % 7)
    return [(head, chunk_bytes - head), (0, head)]


def slot_runs(slot: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Runs of fetch slot `slot`: every fourth contiguous, the others three runs out of order."""
    if CONTIGUOUS or slot % 4 == 0:
        return [(0, chunk_bytes)]
    c1 = PAGE * (1 + slot % 5)
    c2 = chunk_bytes - PAGE * (1 + slot % 3)
    return [(c2, chunk_bytes - c2), (0, c1), (c1, c2 - c1)]


def views_of(pool: memoryview, region: int, runs: list[tuple[int, int]]) -> list[memoryview]:
    return [pool[region + off : region + off + length] for off, length in runs]


def make_pool(size: int) -> mmap.mmap:
    pool = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return pool


def watch_stdin(loop: asyncio.AbstractEventLoop, callback) -> None:
    """Commands come on stdin when it is a pipe (the tests); a file or /dev/null has none."""
    mode = os.fstat(sys.stdin.fileno()).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) and sys.stdin.isatty():
        loop.add_reader(sys.stdin.fileno(), callback)


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def transport_config(args: argparse.Namespace) -> TransportConfig:
    return TransportConfig(
        connect_timeout_s=args.connect_timeout_s,
        settle_timeout_s=args.settle_timeout_s,
        tcp_connections=args.concurrency,
        threads=args.transport.endswith("-threads"),
        ucx=UcxConfig(net_devices=args.ucx_net_devices),
    )


def order_to_json(order: SendOrder) -> dict:
    return {
        "transport": order.transport.value,
        "link_id": order.link_id,
        "transfers": [[t.transfer_id, t.size, t.segments] for t in order.transfers],
    }


def order_from_json(d: dict) -> SendOrder:
    transfers = tuple(Transfer(tid, size, tuple(segments)) for tid, size, segments in d["transfers"])
    return SendOrder(TransportKind(d["transport"]), d["link_id"], transfers)


# -- serve ----------------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    size = args.chunk_bytes
    pool = make_pool(args.chunks * size)
    mv = memoryview(pool)
    arr = np.frombuffer(pool, dtype=np.uint8)
    base = base_content(size, args.seed)
    scratch = np.empty(size, dtype=np.uint8)
    for i in range(args.chunks):
        fill_chunk(scratch, i, base)
        pos = 0
        for off, length in server_runs(i, size):
            arr[i * size + off : i * size + off + length] = scratch[pos : pos + length]
            pos += length
    server = make_server(
        TransportKind(args.transport.removesuffix("-threads")), args.host, args.data_port, transport_config(args)
    )
    bound = await server.start()
    leased = 0

    def unlease(n: int) -> None:
        nonlocal leased
        leased -= n

    def unlease_later(n: int):
        return lambda _: unlease(n)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal leased
        try:
            while line := await reader.readline():
                req = json.loads(line)
                if req["op"] == "stats":
                    resp = {**stats(), "cpu_s": cpu_seconds()}
                else:
                    order = order_from_json(req["order"])
                    sources = [
                        Source(views_of(mv, i * size, server_runs(i, size)), size) if 0 <= i < args.chunks else None
                        for i in req["chunks"]
                    ]
                    leased += len(sources)
                    result = None
                    try:
                        result = await server.send(order, sources, args.send_timeout_s)
                    finally:
                        if result is not None and result.quarantine is not None:
                            result.quarantine.settled.add_done_callback(unlease_later(len(sources)))
                        else:
                            unlease(len(sources))
                    resp = {
                        "outcome": result.outcome.value,
                        "detail": result.detail,
                        "receipts": [[r.transfer_id, r.found, r.length, r.checksum] for r in result.receipts],
                    }
                writer.write(json.dumps(resp).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # the fetcher went away
        finally:
            writer.close()

    def stats() -> dict:
        return {
            "leased": leased,
            "links": server.links,
            "counters": asdict(server.counters),
            "quarantined": len(server.quarantines.pending()),
        }

    def on_stdin() -> None:
        data = os.read(sys.stdin.fileno(), 4096)
        if b"stats" in data:
            emit("stats", **stats(), cpu_s=cpu_seconds())
        if not data or b"stop" in data:
            stop.set()

    control = await asyncio.start_server(handle, args.host, args.control_port)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    watch_stdin(loop, on_stdin)
    emit("ready", pid=os.getpid(), data_port=bound.port, control_port=control.sockets[0].getsockname()[1])
    async with control:
        await stop.wait()
    await server.close()


# -- fetch ----------------------------------------------------------------------------------


class ControlClient:
    """One JSON-lines control connection per worker; a request cut short (cancelled, failed)
    closes it, so a late answer can never be read as the next request's."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(self, req: dict) -> dict:
        ok = False
        try:
            if self._streams is None:
                self._streams = await asyncio.open_connection(self.host, self.port)
            reader, writer = self._streams
            writer.write(json.dumps(req).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
            if not line:
                raise ConnectionError("control connection closed")
            ok = True
            return json.loads(line)
        finally:
            if not ok:
                self.close()

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


async def fetch(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    size = args.chunk_bytes
    data_host, data_port = args.data.rsplit(":", 1)
    ctl_host, ctl_port = args.control.rsplit(":", 1)
    link = make_link(
        TransportKind(args.transport.removesuffix("-threads")),
        PeerAddress(data_host, int(data_port)),
        transport_config(args),
    )
    nslots = args.slots or 2 * args.concurrency * args.batch
    pool = make_pool(nslots * size)
    mv = memoryview(pool)
    base = base_content(size, args.seed)
    free: asyncio.Queue[int] = asyncio.Queue()
    for s in range(nslots):
        free.put_nowait(s)
    counts: dict[str, int] = {}
    totals = {"wrong": 0, "exceptions": 0, "quarantined": 0, "received_bytes": 0}
    stop = asyncio.Event()
    next_chunk = iter(range(args.chunks)) if args.once else _forever(args.chunks)
    first_ok: float | None = None
    last_ok: float | None = None
    first_bytes = 0

    def on_stdin() -> None:
        data = os.read(sys.stdin.fileno(), 4096)
        if not data or b"stop" in data:
            stop.set()

    if not args.once:
        watch_stdin(loop, on_stdin)

    async def worker(w: int) -> None:
        nonlocal first_ok, last_ok, first_bytes
        control = ControlClient(ctl_host, int(ctl_port), args.timeout_s)
        expected = np.empty(size, dtype=np.uint8)
        try:
            while not stop.is_set():
                indices = [i for i in (next(next_chunk, None) for _ in range(args.batch)) if i is not None]
                if not indices:
                    return
                slot_ids = [await free.get() for _ in indices]
                slots = [Slot(views_of(mv, s * size, slot_runs(s, size)), size) for s in slot_ids]

                async def ask(order: SendOrder, indices: list[int] = indices) -> list[Receipt]:
                    resp = await control.request({"op": "send", "chunks": indices, "order": order_to_json(order)})
                    if resp["outcome"] != "sent":
                        raise RuntimeError(f"server: {resp['outcome']}: {resp['detail']}")
                    return [Receipt(*r) for r in resp["receipts"]]

                start = time.perf_counter()
                try:
                    results = await link.receive_batch(slots, ask, args.timeout_s)
                except Exception as exc:  # the contract says this never happens: report it
                    totals["exceptions"] += 1
                    emit("exception", chunks=indices, error=f"{type(exc).__name__}: {exc}")
                    for s in slot_ids:
                        free.put_nowait(s)
                    continue
                elapsed = time.perf_counter() - start
                for index, slot_id, slot, result in zip(indices, slot_ids, slots, results):
                    right = None
                    if result.ok:
                        if not args.no_verify:
                            fill_chunk(expected, index, base)
                            right = _matches(slot.views, expected)
                            totals["wrong"] += not right
                        totals["received_bytes"] += size
                    counts[result.outcome.value] = counts.get(result.outcome.value, 0) + 1
                    if result.quarantine is not None:
                        totals["quarantined"] += 1
                        result.quarantine.settled.add_done_callback(functools.partial(_give_back, free, slot_id))
                    else:
                        free.put_nowait(slot_id)
                    if not args.quiet or not result.ok or right is False:
                        emit(
                            "result",
                            chunk=index,
                            outcome=result.outcome.value,
                            detail=result.detail,
                            right=right,
                            quarantine=result.quarantine is not None,
                            elapsed_s=round(elapsed, 4),
                        )
                    elif counts.get("received", 0) % args.progress_every == 0:
                        emit("progress", received=counts["received"])
                if any(r.ok for r in results):
                    if first_ok is None:  # throughput counts from the end of the first batch
                        first_ok = time.perf_counter()
                        first_bytes = totals["received_bytes"]
                        cpu_marks.append(await _cpu_both(control))
                    else:
                        last_ok = time.perf_counter()
                if not all(r.ok for r in results):
                    await asyncio.sleep(args.pause_after_failure_s)  # don't spin on a peer that is down
        finally:
            control.close()

    cpu_marks: list[tuple[float, float]] = []  # (ours, the server's) at the first and last transfer

    emit("ready", pid=os.getpid())
    started = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for w in range(args.concurrency):
            tg.create_task(worker(w))
    elapsed = time.perf_counter() - started
    if cpu_marks:
        closing = ControlClient(ctl_host, int(ctl_port), args.timeout_s)
        try:
            cpu_marks.append(await _cpu_both(closing))
        finally:
            closing.close()
    settled = await link.quarantines.wait(args.settle_timeout_s)
    summary = {
        "counts": counts,
        **totals,
        "unsettled": 0 if settled else len(link.quarantines.pending()),
        "free_slots": free.qsize(),
        "slots": nslots,
        "connections": link.connections,
        "link": asdict(link.counters),
        "elapsed_s": elapsed,
        "gib_s": (totals["received_bytes"] - first_bytes) / (last_ok - first_ok) / 2**30
        if last_ok and first_ok
        else 0.0,
        # CPU seconds per GiB between the first and the last batch, (fetcher, server), all threads
        "cpu_s_per_gib": _per_gib(cpu_marks, totals["received_bytes"] - first_bytes),
    }
    await link.close()
    summary["connections_after_close"] = link.connections
    summary["cpu_s"] = cpu_seconds()
    emit("summary", **summary)


async def _cpu_both(control: ControlClient) -> tuple[float, float]:
    try:
        server = (await control.request({"op": "stats"}))["cpu_s"]
    except (OSError, ConnectionError, KeyError):
        server = float("nan")
    return cpu_seconds(), server


def _per_gib(marks: list[tuple[float, float]], nbytes: int) -> list[float] | None:
    if len(marks) < 2 or nbytes <= 0:
        return None
    (f0, s0), (f1, s1) = marks[0], marks[-1]
    return [round((f1 - f0) / (nbytes / 2**30), 3), round((s1 - s0) / (nbytes / 2**30), 3)]


def cpu_seconds() -> float:
    """This process's CPU time so far, all threads (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _forever(n: int):
    while True:
        yield from range(n)


def _matches(views: Sequence[memoryview], expected: np.ndarray) -> bool:
    pos = 0
    for view in views:
        got = np.frombuffer(view, dtype=np.uint8)
        if not np.array_equal(got, expected[pos : pos + len(got)]):
            return False
        pos += len(got)
    return True


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.peer.node")
    p.add_argument("role", choices=["serve", "fetch"])
    p.add_argument("--transport", choices=["tcp", "tcp-threads", "ucx"], required=True)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--chunk-bytes", type=int, default=2 << 20)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--connect-timeout-s", type=float, default=2.0)
    p.add_argument("--settle-timeout-s", type=float, default=5.0)
    p.add_argument("--ucx-net-devices", default="all")
    p.add_argument("--contiguous", action="store_true", help="one page run per chunk and slot")
    # serve
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--data-port", type=int, default=0)
    p.add_argument("--control-port", type=int, default=0)
    p.add_argument("--send-timeout-s", type=float, default=2.0)
    # fetch
    p.add_argument("--data", help="HOST:PORT of the server's data plane")
    p.add_argument("--control", help="HOST:PORT of the server's control port")
    p.add_argument("--concurrency", type=int, default=4, help="batches in flight")
    p.add_argument("--batch", type=int, default=1, help="chunks per order")
    p.add_argument("--slots", type=int, default=0, help="default: 2 x concurrency x batch")
    p.add_argument("--timeout-s", type=float, default=2.0, help="each transfer's timeout")
    p.add_argument("--once", action="store_true", help="fetch every chunk once, then stop")
    p.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte check (benchmarks)")
    p.add_argument("--quiet", action="store_true", help="print only failures and progress")
    p.add_argument("--progress-every", type=int, default=16)
    p.add_argument("--pause-after-failure-s", type=float, default=0.05)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    global CONTIGUOUS
    CONTIGUOUS = args.contiguous
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import uvloop

    uvloop.run(serve(args) if args.role == "serve" else fetch(args))


if __name__ == "__main__":
    main()


def _give_back(free: asyncio.Queue, slot_id: int, _settled: object) -> None:
    free.put_nowait(slot_id)
