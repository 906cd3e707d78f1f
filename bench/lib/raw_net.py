# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The raw transports beneath the peer tier: TCP (one connection, or several, a thread each) and
ucxx moving chunks from a populated mapping into a few receive slots, sender and receiver in
processes of their own (on loopback or each in a network namespace). `measure_raw` drives both;
the roles run as `python -m bench.lib.raw_net ROLE`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from bench.lib.buffers import aligned_pool
from bench.lib.daemons import REPO
from bench.lib.report import GIB
from kvstored.peer.transport import UcxConfig
from tests.support import netns

EVENT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Place:
    """Where the two processes run: both on loopback, or each in its own namespace."""

    name: str
    server: netns.Node | None = None
    fetcher: netns.Node | None = None

    @property
    def devices(self) -> str:
        return netns.IFACE if self.server else "lo"

    def argv(self, node: netns.Node | None, argv: list[str]) -> list[str]:
        return node.exec(argv) if node is not None else argv


def _spawn(argv: list[str]) -> subprocess.Popen:
    path = os.pathsep.join([str(REPO), str(REPO / "client"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO, text=True
    )


def _read_json(proc: subprocess.Popen, want: str) -> dict:
    """The first JSON line with event == `want` (other lines skipped)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    for line in proc.stdout:
        with contextlib.suppress(json.JSONDecodeError):
            if (event := json.loads(line)).get("event") == want:
                return event
        if time.monotonic() > deadline:
            break
    err = proc.stderr.read() if proc.stderr else ""
    cmd = " ".join(map(str, proc.args[-8:])) if isinstance(proc.args, list) else str(proc.args)
    raise RuntimeError(f"{cmd} gave no {want!r} (exit {proc.poll()}): {err[-2000:]}")


def _ring(chunk: int, n: int) -> list[memoryview]:
    """`n` populated chunk buffers: the sender's are all the chunks it sends (as the serving node
    holds them: a small ring would be served from the CPU cache), the receiver's as many slots
    as the fetching node uses."""
    mv = memoryview(aligned_pool(n * chunk))
    return [mv[i * chunk : (i + 1) * chunk] for i in range(n)]


def _emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _threads(fn, conns: int) -> None:
    """fn(k) for each connection k, each in a thread of its own (socket calls release the GIL, so
    the kernel's copies of several connections run on several CPUs); an error is raised."""
    with ThreadPoolExecutor(conns) as pool:
        list(pool.map(fn, range(conns)))


def raw_tcp_recv(args: argparse.Namespace) -> None:
    """Accepts `conns` connections; each lands its share of the chunks in its own slots. Timed from
    the end of the first chunk (connection 0's) to the end of the last, on any connection."""
    listener = socket.create_server((args.host, 0), backlog=args.conns)  # (SO_REUSEADDR set)
    _emit("ready", port=listener.getsockname()[1])
    conns = [listener.accept()[0] for _ in range(args.conns)]
    ring = _ring(args.chunk, args.slots)
    first_end = cpu0 = 0.0

    def receive(k: int) -> None:
        nonlocal first_end, cpu0
        conn = conns[k]
        for i in range(k, args.count, args.conns):  # every conns-th chunk, from the connection's number
            view, got = ring[i % args.slots], 0
            while got < args.chunk:
                n = conn.recv_into(view[got:])
                if not n:
                    raise EOFError("sender closed early")
                got += n
            if i == 0:
                first_end, cpu0 = time.perf_counter(), _cpu()

    _threads(receive, args.conns)
    end = time.perf_counter()
    gib = (args.count - 1) * args.chunk / GIB
    _emit("done", gib_s=gib / (end - first_end), cpu_s_per_gib=(_cpu() - cpu0) / gib)


def raw_tcp_send(args: argparse.Namespace) -> None:
    conns = [socket.create_connection((args.host, args.port)) for _ in range(args.conns)]
    for conn in conns:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ring = _ring(args.chunk, args.count)
    cpu0 = _cpu()

    def send(k: int) -> None:
        for i in range(k, args.count, args.conns):
            conns[k].sendall(ring[i])

    _threads(send, args.conns)
    _emit("done", cpu_s_per_gib=(_cpu() - cpu0) / (args.count * args.chunk / GIB))
    for conn in conns:
        conn.shutdown(socket.SHUT_WR)
    for conn in conns:
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


async def raw_ucx_recv(args: argparse.Namespace) -> None:
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


async def raw_ucx_send(args: argparse.Namespace) -> None:
    ucxx = _ucxx(args.devices)
    ring = _ring(args.chunk, args.count)
    ep = await ucxx.create_endpoint(args.host, args.port)
    _, _, cpu = await _windowed(args.count, args.window, lambda i: ep.send(ring[i], tag=i, force_tag=True))
    _emit("done", cpu_s_per_gib=cpu / ((args.count - 1) * args.chunk / GIB))
    await ep.send(bytearray(1), tag=args.count, force_tag=True)
    ucxx.stop_notifier_thread()


@dataclass(frozen=True)
class Sample:
    gib_s: float
    cpu_s_per_gib: tuple[float, float]  # (fetching side, serving side), all threads


def measure_raw(
    transport: str, place: Place, nbytes: int, chunk: int, slots: int, ucx_window: int = 1, conns: int = 1
) -> Sample:
    """One raw transfer of `nbytes` from place.server to place.fetcher, landing in `slots` buffers
    (TCP: over `conns` connections at once, a thread each on both sides)."""
    count = nbytes // chunk
    me = [sys.executable, "-m", "bench.lib.raw_net"]
    common = f"--chunk {chunk} --count {count} --slots {slots} --devices {place.devices} --window {ucx_window}".split()
    common += ["--conns", str(conns)]
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
        for p in (recv, send) if send else (recv,):
            if p.poll() is None:
                p.kill()  # our own children, by pid
            p.wait()


ROLES = {f.__name__.replace("_", "-"): f for f in (raw_tcp_recv, raw_tcp_send, raw_ucx_recv, raw_ucx_send)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one side of a raw transfer (measure_raw starts both)")
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--devices", default="lo")
    # --window: ucxx transfers in flight; --conns: TCP connections, a thread each; None: required
    for flag, default in {"port": 0, "chunk": None, "count": None, "window": 1, "slots": 64, "conns": 1}.items():
        p.add_argument(f"--{flag}", type=int, default=default, required=default is None)
    args = p.parse_args(argv)
    ran = ROLES[args.role](args)
    if asyncio.iscoroutine(ran):  # a ucxx role
        asyncio.run(ran)
        os._exit(0)  # ucxx's teardown at exit can outlast the measurement by seconds
    return 0


if __name__ == "__main__":
    sys.exit(main())
