# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The peer data plane against the raw transports beneath it (issue 11 part 8's groundwork; not a test).

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from bench.lib.daemons import REPO
from bench.lib.report import GIB, MIB, Row, machine_info, print_table, write_json
from kvstored.peer.transport import UcxConfig
from tests.support import netns

TARGET = 0.8
EVENT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Place:
    """Where the two processes run: both on loopback, or each in its own namespace."""

    name: str
    server: netns.Node | None = None
    fetcher: netns.Node | None = None

    @property
    def server_host(self) -> str:
        return self.server.ip if self.server else "127.0.0.1"

    @property
    def devices(self) -> str:
        return netns.IFACE if self.server else "lo"

    def argv(self, node: netns.Node | None, argv: list[str]) -> list[str]:
        return node.exec(argv) if node is not None else argv


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "client"), env.get("PYTHONPATH", "")])
    return env


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO, text=True
    )


def _read_json(proc: subprocess.Popen, want: str) -> dict:
    """The first JSON line with event == `want` (other lines skipped)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    for line in proc.stdout:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == want:
            return event
        if time.monotonic() > deadline:
            break
    err = proc.stderr.read() if proc.stderr else ""
    cmd = " ".join(map(str, proc.args[-8:])) if isinstance(proc.args, list) else str(proc.args)
    raise RuntimeError(f"{cmd} gave no {want!r} (exit {proc.poll()}): {err[-2000:]}")


def _finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # our own children, by pid
        p.wait()


# -- raw arms (run as `python bench/peer_raw.py raw-...`) -------------------------------------


def _ring(chunk: int, n: int) -> list[memoryview]:
    """`n` populated chunk buffers: the sender's are all the chunks it sends (as the serving node
    holds them: a small ring would be served from the CPU cache), the receiver's as many slots
    as the fetching node uses."""
    pool = mmap.mmap(-1, n * chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    mv = memoryview(pool)
    return [mv[i * chunk : (i + 1) * chunk] for i in range(n)]


def _emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def raw_tcp_recv(args: argparse.Namespace) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, 0))
    listener.listen(1)
    _emit("ready", port=listener.getsockname()[1])
    conn, _ = listener.accept()
    ring = _ring(args.chunk, args.slots)
    first_end = cpu0 = 0.0
    for i in range(args.count):
        view, got = ring[i % args.slots], 0
        while got < args.chunk:
            n = conn.recv_into(view[got:])
            if not n:
                raise EOFError("sender closed early")
            got += n
        if i == 0:
            first_end, cpu0 = time.perf_counter(), _cpu()
    end = time.perf_counter()
    gib = (args.count - 1) * args.chunk / GIB
    _emit("done", gib_s=gib / (end - first_end), cpu_s_per_gib=(_cpu() - cpu0) / gib)


def raw_tcp_send(args: argparse.Namespace) -> None:
    conn = socket.create_connection((args.host, args.port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ring = _ring(args.chunk, args.count)
    cpu0 = _cpu()
    for i in range(args.count):
        conn.sendall(ring[i])
    _emit("done", cpu_s_per_gib=(_cpu() - cpu0) / (args.count * args.chunk / GIB))
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # until the receiver closes


def _ucxx(devices: str):
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCXX_LOG_LEVEL", "ERROR")
    import ucxx

    ucxx.init(options=UcxConfig(net_devices=devices).options(), progress_mode="thread", enable_python_future=True)
    return ucxx


async def _windowed(count: int, window: int, op) -> tuple[float, float, float]:
    """Run op(i) for every i with at most `window` in flight; (end of op 0, end of the last, CPU
    seconds between them)."""
    first_end = cpu0 = 0.0
    inflight: set[asyncio.Task] = set()
    for i in range(count):
        while len(inflight) >= window:
            done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()
        task = asyncio.get_running_loop().create_task(op(i))
        inflight.add(task)
        if i == 0:
            await task
            first_end, cpu0 = time.perf_counter(), _cpu()
            inflight.clear()
    for t in inflight:
        await t
    return first_end, time.perf_counter(), _cpu() - cpu0


def raw_ucx_recv(args: argparse.Namespace) -> None:
    async def main() -> None:
        ucxx = _ucxx(args.devices)
        ring = _ring(args.chunk, args.slots)
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_endpoint(ep) -> None:
            try:
                first_end, end, cpu = await _windowed(
                    args.count, args.window, lambda i: ep.recv(ring[i % args.slots], tag=i, force_tag=True)
                )
                gib = (args.count - 1) * args.chunk / GIB
                done.set_result({"gib_s": gib / (end - first_end), "cpu_s_per_gib": cpu / gib})
                await ep.recv(bytearray(1), tag=args.count, force_tag=True)  # the sender's "bye"
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)

        listener = ucxx.create_listener(on_endpoint, port=0)
        _emit("ready", port=listener.port)
        _emit("done", **await done)
        await asyncio.sleep(0.2)  # let the bye land before the endpoint goes
        listener.close()
        ucxx.stop_notifier_thread()

    asyncio.run(main())
    os._exit(0)  # ucxx's teardown at exit can outlast the measurement by seconds


def raw_ucx_send(args: argparse.Namespace) -> None:
    async def main() -> None:
        ucxx = _ucxx(args.devices)
        ring = _ring(args.chunk, args.count)
        ep = await ucxx.create_endpoint(args.host, args.port)
        _, _, cpu = await _windowed(args.count, args.window, lambda i: ep.send(ring[i], tag=i, force_tag=True))
        _emit("done", cpu_s_per_gib=cpu / ((args.count - 1) * args.chunk / GIB))
        await ep.send(bytearray(1), tag=args.count, force_tag=True)
        ucxx.stop_notifier_thread()

    asyncio.run(main())
    os._exit(0)


# -- arms as seen from the driver -----------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    gib_s: float
    cpu_s_per_gib: tuple[float, float]  # (fetching side, serving side), all threads


def measure_raw(transport: str, place: Place, nbytes: int, chunk: int, slots: int, ucx_window: int = 1) -> Sample:
    """One raw transfer of `nbytes` from place.server to place.fetcher, landing in `slots` buffers."""
    count = nbytes // chunk
    me = [sys.executable, "-m", "bench.peer_raw"]
    common = [
        "--chunk",
        str(chunk),
        "--count",
        str(count),
        "--slots",
        str(slots),
        "--devices",
        place.devices,
        "--window",
        str(ucx_window),
    ]
    host = place.fetcher.ip if place.fetcher else "127.0.0.1"
    recv = _spawn(place.argv(place.fetcher, [*me, f"raw-{transport}-recv", "--host", host, *common]))
    send = None
    try:
        port = _read_json(recv, "ready")["port"]
        send = _spawn(
            place.argv(place.server, [*me, f"raw-{transport}-send", "--host", host, "--port", str(port), *common])
        )
        done = _read_json(recv, "done")
        sent = _read_json(send, "done")
        return Sample(done["gib_s"], (done["cpu_s_per_gib"], sent["cpu_s_per_gib"]))
    finally:
        _finish(recv, *([send] if send else []))


def measure_peer(transport: str, place: Place, nbytes: int, chunk: int, concurrency: int, batch: int = 1) -> Sample:
    """kvstored.peer moving `nbytes` from a serving node to a fetching node."""
    count = nbytes // chunk
    node = [sys.executable, "-m", "tests.peer.node"]
    common = [
        "--transport",
        transport,
        "--chunks",
        str(count),
        "--chunk-bytes",
        str(chunk),
        "--ucx-net-devices",
        place.devices,
        "--contiguous",
    ]
    server = _spawn(place.argv(place.server, [*node, "serve", *common, "--host", place.server_host]))
    fetcher = None
    try:
        ready = _read_json(server, "ready")
        fetcher = _spawn(
            place.argv(
                place.fetcher,
                [
                    *node,
                    "fetch",
                    *common,
                    "--once",
                    "--no-verify",
                    "--quiet",
                    "--progress-every",
                    str(count + 1),
                    "--concurrency",
                    str(concurrency),
                    "--batch",
                    str(batch),
                    "--timeout-s",
                    "30",
                    "--data",
                    f"{place.server_host}:{ready['data_port']}",
                    "--control",
                    f"{place.server_host}:{ready['control_port']}",
                ],
            )
        )
        summary = _read_json(fetcher, "summary")
        if summary["counts"] != {"received": count}:
            raise RuntimeError(f"peer {transport}: {summary['counts']}")
        return Sample(summary["gib_s"], tuple(summary["cpu_s_per_gib"] or (float("nan"),) * 2))
    finally:
        _finish(server, *([fetcher] if fetcher else []))


# -- driver -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> tuple[list[Row], dict]:
    nbytes, chunk = int(args.gib * GIB), args.chunk_mib * MIB
    transports = args.transports.split(",")
    wheres = args.where.split(",")
    samples: dict[str, list[Sample]] = {}
    topology = None
    places = []
    try:
        if "loopback" in wheres:
            places.append(Place("loopback"))
        if "netns" in wheres:
            reason = netns.unavailable()
            if reason:
                print(f"netns skipped: {reason}", file=sys.stderr)
            else:
                topology = netns.Topology(nodes=2)
                topology.create()
                places.append(Place("netns", topology.nodes[0], topology.nodes[1]))
        arms = [(p, t, kind) for p in places for t in transports for kind in ("raw", "peer")]
        for r in range(args.rounds):
            shift = r % len(arms)
            for place, transport, kind in arms[shift:] + arms[:shift]:
                if kind == "raw":
                    value = measure_raw(
                        transport, place, nbytes, chunk, 2 * args.concurrency * args.batch, args.ucx_window
                    )
                else:
                    value = measure_peer(transport, place, nbytes, chunk, args.concurrency, args.batch)
                key = f"{kind} {transport} ({place.name})"
                samples.setdefault(key, []).append(value)
                print(
                    f"round {r}: {key}: {value.gib_s:.2f} GiB/s, CPU s/GiB fetcher {value.cpu_s_per_gib[0]:.2f} "
                    f"server {value.cpu_s_per_gib[1]:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if topology is not None:
            topology.close()
    rows = []
    for place in places:
        for transport in transports:
            peer = samples[f"peer {transport} ({place.name})"]
            raw = samples[f"raw {transport} ({place.name})"]
            rows.append(
                Row(
                    name=f"peer {transport} ({place.name})",
                    value=statistics.median(s.gib_s for s in peer),
                    unit="GiB/s",
                    baseline_name=f"raw {transport}",
                    baseline=statistics.median(s.gib_s for s in raw),
                    target=TARGET,
                    median=statistics.median(s.gib_s for s in peer),
                    note=f"per round GiB/s: peer {_list(s.gib_s for s in peer)}; raw {_list(s.gib_s for s in raw)}; "
                    f"CPU s/GiB (fetcher+server, median): peer {_cpu_pair(peer)}, raw {_cpu_pair(raw)}",
                )
            )
    return rows, {k: [asdict(s) for s in v] for k, v in samples.items()}


def _list(values) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _cpu_pair(samples: list[Sample]) -> str:
    fetcher = statistics.median(s.cpu_s_per_gib[0] for s in samples)
    server = statistics.median(s.cpu_s_per_gib[1] for s in samples)
    return f"{fetcher:.2f}+{server:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role")
    for role in ("raw-tcp-recv", "raw-tcp-send", "raw-ucx-recv", "raw-ucx-send"):
        r = sub.add_parser(role)
        r.add_argument("--host", default="127.0.0.1")
        r.add_argument("--port", type=int, default=0)
        r.add_argument("--chunk", type=int, required=True)
        r.add_argument("--count", type=int, required=True)
        r.add_argument("--devices", default="lo")
        r.add_argument("--window", type=int, default=1)
        r.add_argument("--slots", type=int, default=64)
    p.add_argument("--where", default="loopback,netns")
    p.add_argument("--transports", default="tcp,ucx")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--chunk-mib", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="peer orders in flight")
    p.add_argument("--batch", type=int, default=8, help="chunks per peer order")
    p.add_argument("--ucx-window", type=int, default=1, help="raw ucx messages in flight")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    roles = {
        "raw-tcp-recv": raw_tcp_recv,
        "raw-tcp-send": raw_tcp_send,
        "raw-ucx-recv": raw_ucx_recv,
        "raw-ucx-send": raw_ucx_send,
    }
    if args.role:
        roles[args.role](args)
        return 0
    try:
        rows, samples = run(args)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 2
    print_table(
        rows,
        title=f"peer data plane vs raw transports ({args.gib:g} GiB of {args.chunk_mib} MiB chunks, "
        f"{args.concurrency} orders of {args.batch} in flight, median of {args.rounds} rounds)",
    )
    if args.json:
        write_json(
            args.json,
            {
                "bench": "peer_raw",
                "machine": machine_info(),
                "args": vars(args),
                "rows": [r.to_json() for r in rows],
                "samples": samples,
            },
        )
    return 0 if all(r.status == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
