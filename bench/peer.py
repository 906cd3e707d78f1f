"""Node B loading what only node A holds, through the peer tier, beside the raw transports beneath
it (a raw TCP socket, raw ucxx), B's cold fs tier and the S3 tier on radosgw (issue 11 part 8; not
a test).

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.lib.buffers import populate
from bench.lib.daemons import Daemon, cpu_of, free_port, process_cpu_seconds
from bench.lib.limits import drop_page_cache, raw_odirect
from bench.lib.report import GIB, MIB, Row, load_average, machine_info, print_table, write_json
from bench.lib.s3 import raw_s3_get, start_s3
from bench.peer_raw import Place, measure_raw

TARGET = 0.8
WAIT_S = 120.0  # bound on waiting for the cluster's state (never a measurement)
FS_THREADS = 8  # the fs tier's io_threads (the daemon's default): raw O_DIRECT at that depth
S3_INFLIGHT = 16  # the S3 tier's requests in flight (the daemon's default)
STORE_BATCH = 64
# Not the default 1 s: a stall of this shared machine must not turn into misses (they end the run).
FETCH_TIMEOUT_S = 5.0
COPIED = "client load + copy out"


@dataclass(frozen=True)
class Chunks:
    """`n` chunks of `size` bytes, each of its own content (generated, not kept), and their keys."""

    n: int
    size: int

    @property
    def nbytes(self) -> int:
        return self.n * self.size

    @property
    def keys(self) -> list[bytes]:
        return [f"bench-peer:{i}".encode().ljust(32, b".") for i in range(self.n)]

    def content(self, first: int, count: int) -> np.ndarray:
        """Chunks first..first+count-1: a counter with each chunk's index in the high bits."""
        words = np.arange(self.size // 8, dtype=np.uint64)
        out = np.empty((count, self.size // 8), np.uint64)
        for k in range(count):
            np.bitwise_xor(words, np.uint64((first + k + 1) << 40), out=out[k])
        return out.view(np.uint8)

    def wrong(self, out: np.ndarray) -> int:
        """How many chunks of `out` are not their own bytes."""
        return sum(not np.array_equal(out[i], self.content(i, 1)[0]) for i in range(self.n))


@dataclass
class Measured:
    """One arm's round: GiB/s and CPU s/GiB (fetching side, serving side)."""

    gib_s: float
    cpu_s_per_gib: tuple[float, float]
    client_cpu_s_per_gib: float = float("nan")  # of the fetching side's: the clients' (calls, copies out)


def namespace(client, chunks: Chunks, model: str):
    return client.register_namespace(model=model, dtype="u8", chunk_bytes=chunks.size)


def store(daemon: Daemon, chunks: Chunks, model: str) -> None:
    from kvstored_client import Client

    keys = chunks.keys
    with Client(str(daemon.socket), deadline_s=120.0) as kv:
        ns = namespace(kv, chunks, model)
        for i in range(0, chunks.n, STORE_BATCH):
            batch = keys[i:i + STORE_BATCH]
            r = kv.store(ns, batch, chunks.content(i, len(batch)))
            if r.stored + r.already_present != len(batch):
                raise RuntimeError(f"storing on {daemon.socket}: {r}")


def ram_chunks(daemon: Daemon) -> int:
    """Chunks in the daemon's RAM (Stats: a Lookup would start promoting them)."""
    from kvstored_client import Client

    with Client(str(daemon.socket), deadline_s=60.0) as kv:
        return next(t.chunks for t in kv.stats().tiers if t.name == "ram")


class Leaser:
    """A client loading as vLLM's direct mode does (KvstoredOffloadingSpec): Acquire gives leases
    on the chunks in the daemon's RAM, promoted from below first (the GPU would then read the
    pool), then Release. No copy: what it waits for is the tier's work alone."""

    def __init__(self, daemon: Daemon, namespace_id: str, name: str) -> None:
        import grpc

        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
        from kvstored_client.session import PoolSession

        self._pb = pb
        self._session = PoolSession.open(daemon.socket, name, timeout=10.0, populate=False)
        self._channel = grpc.insecure_channel(f"unix:{daemon.socket}")
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._namespace_id = namespace_id

    def load(self, keys: list[bytes], _out: np.ndarray) -> int:
        pb, sid = self._pb, self._session.session_id
        leases = self._stub.Acquire(pb.AcquireRequest(session_id=sid, namespace_id=self._namespace_id, keys=keys),
                                    timeout=120.0).leases
        self._stub.Release(pb.ReleaseRequest(session_id=sid, handles=[lease.handle for lease in leases]),
                           timeout=120.0)
        return len(leases)

    def close(self) -> None:
        self._channel.close()
        self._session.close()


class Copier:
    """A client loading with kvstored_client's `load`: Acquire, copy into the caller's buffer, Release."""

    def __init__(self, daemon: Daemon, chunks: Chunks, model: str, name: str) -> None:
        from kvstored_client import Client

        self._kv = Client(str(daemon.socket), deadline_s=120.0, client_name=name)
        self._ns = namespace(self._kv, chunks, model)
        self._kv.load(self._ns, [], np.empty((0, chunks.size), np.uint8))  # the session (and its pool mapping) now

    def load(self, keys: list[bytes], out: np.ndarray) -> int:
        return self._kv.load(self._ns, keys, out)

    def close(self) -> None:
        self._kv.close()


def load_all(daemon: Daemon, chunks: Chunks, model: str, out: np.ndarray, batch: int, clients: int,
             copy: bool, serving: Sequence[int] = ()) -> Measured:
    """Load every chunk through `clients` clients of `daemon` (`batch` chunks per call, the calls
    dealt out in turn): leases (`copy` False) or copies into `out`. Timed from the first call to
    the last answer, with the CPU the daemon, the clients (this process) and `serving` used
    meanwhile. Then (untimed) every chunk is compared, copied out of the daemon's RAM: a
    RuntimeError if one was not loaded or came back with other bytes."""
    from kvstored_client import Client

    out[:] = 0
    keys = chunks.keys
    with Client(str(daemon.socket), deadline_s=120.0) as kv:
        namespace_id = namespace(kv, chunks, model).namespace_id
    loaders: list[Leaser | Copier] = []
    try:
        for k in range(clients):
            loaders.append(Copier(daemon, chunks, model, f"bench-peer-{k}") if copy
                           else Leaser(daemon, namespace_id, f"bench-peer-{k}"))
        starts = list(range(0, chunks.n, batch))
        loaded = [0] * len(starts)
        go = threading.Barrier(clients + 1)

        def run(k: int) -> None:
            go.wait()
            for j in range(k, len(starts), clients):
                s = starts[j]
                loaded[j] = loaders[k].load(keys[s:s + batch], out[s:s + batch])

        threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        fetching0, serving0, me0 = process_cpu_seconds(daemon.pid), cpu_of(serving), time.process_time()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        me = time.process_time() - me0
        fetching, served = process_cpu_seconds(daemon.pid) - fetching0, cpu_of(serving) - serving0
    finally:
        for loader in loaders:
            loader.close()
    if sum(loaded) != chunks.n:
        raise RuntimeError(f"{daemon.socket}: loaded {sum(loaded)} of {chunks.n} chunks")
    if not copy:
        with Client(str(daemon.socket), deadline_s=120.0) as kv:  # from the daemon's RAM now
            if kv.load(namespace(kv, chunks, model), keys, out) != chunks.n:
                raise RuntimeError(f"{daemon.socket}: the leased chunks did not stay in RAM")
    wrong = chunks.wrong(out)
    if wrong:
        raise RuntimeError(f"{daemon.socket}: {wrong} chunks came back with other bytes")
    gib = chunks.nbytes / GIB
    return Measured(gib / wall, ((fetching + me) / gib, served / gib if serving else float("nan")), me / gib)


def ram_for(chunks: Chunks) -> str:
    return str(int(chunks.nbytes * 1.25) + 64 * MIB)  # the chunks, the write-back headroom, slack


# -- the peer tier ------------------------------------------------------------------------------


class Cluster:
    """Node A (serves both transports) and a node B per transport (fetches from A only)."""

    MODEL = "bench/peer"

    def __init__(self, transports: Sequence[str], chunks: Chunks) -> None:
        self.chunks = chunks
        names = ["A", *transports]
        self.addresses = {name: f"127.0.0.1:{free_port()}" for name in names}
        a = self.addresses["A"]

        def node(transport: str, peers: Sequence[str], listen: str) -> Daemon:
            spec = ",".join(["kind=peer", f"transport={transport}", f"peers={' '.join(peers)}",
                             "tcp_port=0", "ucx_port=0", "ucx_net_devices=lo", f"fetch_timeout_s={FETCH_TIMEOUT_S}"])
            return Daemon(ram_for(chunks), extra_args=["--metrics-addr", "off", "--tcp-listen", listen,
                                                       "--tiers", spec], start_timeout_s=WAIT_S)

        self.a = node("auto", list(self.addresses.values()), a)
        self.b = {t: node(t, [a, self.addresses[t]], self.addresses[t]) for t in transports}

    def start(self) -> None:
        self.a.start()
        for b in self.b.values():
            b.start()
        store(self.a, self.chunks, self.MODEL)
        for transport in self.b:
            self._wait_indexed(transport)

    def _a_seen_by(self, transport: str):
        """B's view of A (kvstored.v1.Peer/Status): state, transport, index, counters."""
        import grpc

        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"unix:{self.b[transport].socket}") as channel:
            status = pb_grpc.PeerStub(channel).Status(pb.PeerStatusRequest(), timeout=10)
        return next((p for p in status.peers if p.address == self.addresses["A"]), None)

    def _wait_indexed(self, transport: str) -> None:
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

        deadline = time.monotonic() + WAIT_S
        while True:
            a = self._a_seen_by(transport)
            if a is not None and a.state == pb.PEER_STATE_UP and a.indexed_chunks >= self.chunks.n:
                if a.transport != transport:
                    raise RuntimeError(f"B reaches A over {a.transport}, not {transport}")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"B ({transport}) never indexed A's {self.chunks.n} chunks: {a}")
            time.sleep(0.1)

    def measure(self, transport: str, out: np.ndarray, batch: int, clients: int, copy: bool) -> Measured:
        from kvstored_client import Client

        b = self.b[transport]
        if ram_chunks(b):
            raise RuntimeError(f"before the load, B ({transport}) holds chunks in its RAM")
        try:
            m = load_all(b, self.chunks, self.MODEL, out, batch, clients, copy, serving=[self.a.pid])
        except RuntimeError as exc:
            a = self._a_seen_by(transport)
            raise RuntimeError(f"{exc}; B's counters for A: " + ", ".join(
                f"{k} {getattr(a, k, '?')}" for k in ("missing_chunks", "corrupt_chunks", "failed_chunks",
                                                     "timed_out_chunks", "refused_by_breaker"))) from None
        with Client(str(b.socket), deadline_s=60.0) as kv:  # B's copies only: A keeps its own
            kv.delete(namespace(kv, self.chunks, self.MODEL), self.chunks.keys)
        return m

    def stop(self) -> None:
        for d in [*self.b.values(), self.a]:
            with contextlib.suppress(Exception):
                d.stop()


# -- cold tiers: a daemon with one tier below RAM, started afresh each round ---------------------


class ColdTier:
    """The chunks written down to `spec` once (a daemon stopped with a long flush); each round a
    daemon with the same tier starts with its RAM empty, and its clients load them."""

    def __init__(self, spec: str, chunks: Chunks, model: str) -> None:
        self.spec, self.chunks, self.model = spec, chunks, model

    def _daemon(self, flush_s: float) -> Daemon:
        return Daemon(ram_for(self.chunks), extra_args=["--metrics-addr", "off", "--tiers", self.spec,
                                                        "--flush-on-stop-seconds", str(flush_s)],
                      start_timeout_s=WAIT_S)

    def prepare(self) -> None:
        daemon = self._daemon(600.0)
        daemon.start()
        try:
            store(daemon, self.chunks, self.model)
        finally:
            if daemon.stop(timeout_s=660.0) != 0:
                raise RuntimeError(f"the daemon writing down to {self.spec} exited badly: {daemon.log_tail()}")

    def measure(self, out: np.ndarray, batch: int, clients: int, drop: bool) -> Measured:
        """Leases, as the peer tier's row (the bytes in the daemon's RAM)."""
        daemon = self._daemon(0.0)
        if drop:
            drop_page_cache()
        daemon.start()
        try:
            if ram_chunks(daemon):
                raise RuntimeError(f"{self.spec}: the restarted daemon holds chunks in RAM")
            return load_all(daemon, self.chunks, self.model, out, batch, clients, copy=False)
        finally:
            daemon.stop()


def raw(transport: str, chunks: Chunks, slots: int) -> Measured:
    """The same bytes over a raw socket / raw ucxx, landing in `slots` buffers (as many as the
    clients' loads have in flight)."""
    s = measure_raw(transport, Place("loopback"), chunks.nbytes, chunks.size, slots)
    return Measured(s.gib_s, s.cpu_s_per_gib)


def odirect(workdir: Path, chunks: Chunks) -> Measured:
    limit = raw_odirect(workdir, chunks.n, chunks.size, FS_THREADS)
    return Measured(limit.read_gib_s, (float("nan"), float("nan")))


def raw_s3(endpoint, bucket: str) -> Measured:
    gib_s, cpu = raw_s3_get(endpoint, bucket, S3_INFLIGHT)
    return Measured(gib_s, (cpu, float("nan")))


# -- driver -------------------------------------------------------------------------------------


def rounds(arms: dict[str, Callable[[], Measured]], count: int, samples: dict[str, list[Measured]],
           failures: list[str]) -> None:
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
            print(f"round {r}: {name}: {m.gib_s:.2f} GiB/s" + (f", CPU s/GiB {cpu}" if cpu else "") +
                  f"; load average {load_average():.2f}", file=sys.stderr, flush=True)


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
                arms[f"peer tier over {t}"] = lambda t=t: cluster.measure(t, out, args.batch, args.clients, False)
                arms[f"{COPIED} over {t}"] = lambda t=t: cluster.measure(t, out, args.batch, args.clients, True)
                arms[f"raw {t}"] = lambda t=t: raw(t, chunks, slots=args.batch * args.clients)
            rounds(arms, args.rounds, samples, failures)
        finally:
            cluster.stop()

    def fs() -> None:
        cold = ColdTier(f"kind=fs,root={workdir / 'fs'},bytes={4 * chunks.nbytes}", chunks, "bench/peer-fs")
        cold.prepare()
        rounds({"fs tier, cold": lambda: cold.measure(out, args.batch, args.clients, drop=True),
                "raw O_DIRECT read": lambda: odirect(workdir, chunks)}, args.rounds, samples, failures)

    def s3() -> None:
        server = start_s3(args.s3, memstore_bytes=2 * chunks.nbytes + GIB)
        try:
            if server.note:
                notes.append(server.note)
            ep, bucket = server.endpoint, server.new_bucket(f"kvstored-bench-peer-{os.getpid()}")
            cold = ColdTier(server.tier_spec(bucket, 0), chunks, "bench/peer-s3")
            cold.prepare()
            rounds({f"S3 tier ({server.kind})": lambda: cold.measure(out, args.batch, args.clients, drop=False),
                    "raw S3 GET": lambda: raw_s3(ep, bucket)}, args.rounds, samples, failures)
        finally:
            server.stop()

    try:
        part("peer", failures, peers)
        if args.fs == "on":
            part("fs", failures, fs)
        if args.s3 != "off":
            part("s3", failures, s3)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return samples


def rows(samples: dict[str, list[Measured]]) -> list[Row]:
    def median(name: str) -> float | None:
        return statistics.median(m.gib_s for m in samples[name]) if name in samples else None

    out: list[Row] = []
    for prefix, target in (("peer tier", TARGET), (COPIED, None)):  # the targeted rows first
        for name in samples:
            if name.startswith(prefix):
                raw = f"raw {name.rsplit(' ', 1)[1]}"
                out.append(Row(name=name, value=median(name) or 0.0, unit="GiB/s", baseline_name=raw,
                               baseline=median(raw), target=target, median=median(name),
                               limit=f"{raw} on loopback (the kernel's copies; same run)",
                               note=_note(samples, name, raw)))
    peer = next((r.name for r in out if r.name == "peer tier over tcp"), out[0].name if out else "")
    for name in samples:
        if name.startswith(("fs", "S3")):
            limit = "raw O_DIRECT read" if name.startswith("fs") else "raw S3 GET"
            depth = f"{FS_THREADS} threads" if name.startswith("fs") else f"the tier's objects, {S3_INFLIGHT} in flight"
            lim = median(limit)
            out.append(Row(name=name, value=median(name) or 0.0, unit="GiB/s", baseline_name=peer,
                           baseline=median(peer) if peer else None, median=median(name),
                           limit=f"{limit}, {depth}: " + (f"{lim:.2f} GiB/s" if lim else "not measured"),
                           note=_note(samples, name, limit)))
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
    return (f"per round GiB/s: {name} {per_round(name)}; {base} {per_round(base)} (paired ratios {paired}); "
            f"CPU s/GiB, fetching+serving (median): {name} {cpu(name)}, {base} {cpu(base)}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--gib", type=float, default=1.0, help="bytes each arm moves (default 1 GiB)")
    p.add_argument("--chunk-mib", type=int, default=2, help="chunk size (default 2 MiB)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each arm once per round (default 3)")
    p.add_argument("--transports", default="tcp,ucx", help="peer tier transports (default tcp,ucx)")
    p.add_argument("--batch", type=int, default=32, help="chunks per load call (default 32)")
    p.add_argument("--clients", type=int, default=2, help="clients loading at once (default 2)")
    p.add_argument("--fs", choices=("on", "off"), default="on", help="the cold fs tier row")
    p.add_argument("--s3", choices=("rgw", "moto", "off"), default="rgw",
                   help="the S3 row: radosgw (moto_server if it cannot start), moto_server, or none")
    p.add_argument("--dir", default=None, help="where the fs tier and raw O_DIRECT files go (default: temp dir)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    load0 = load_average()
    print(f"peer tier benchmark: {args.gib:g} GiB of {args.chunk_mib} MiB chunks, {args.rounds} rounds (median); "
          f"load average {load0:.2f} on {os.cpu_count()} CPUs", flush=True)
    notes: list[str] = []
    failures: list[str] = []
    t0 = time.perf_counter()
    samples = run(args, notes, failures)
    table = rows(samples)
    load1 = load_average()
    print_table(table, title=f"\nB loading what only A holds ({args.clients} clients, {args.batch} chunks per call) "
                             "beside the raw transports; fs and S3: ratio = the row / the peer tier over tcp")
    for line in notes + failures:
        print(f"  * {line}")
    print(f"\nload average {load0:.2f} at start, {load1:.2f} at end; total {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, {"bench": "peer", "machine": machine_info(), "args": vars(args),
                               "load_average": {"start": load0, "end": load1}, "rows": [r.to_json() for r in table],
                               "samples": {k: [asdict(m) for m in v] for k, v in samples.items()},
                               "notes": notes, "failures": failures})
    if failures:
        return 2
    return 0 if all(r.status == "PASS" for r in table if r.target is not None) else 1


if __name__ == "__main__":
    sys.exit(main())
