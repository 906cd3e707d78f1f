"""Shared helpers for the kvstored benchmarks (not tests).

- `Daemon`: start `kvstored serve` as a subprocess on a temp socket, wait until it is SERVING
  (grpc.health.v1), stop it with SIGTERM.
- `ShmFile`: a populated /dev/shm file mapped as a numpy array (for region registration).
- `populate()` / `fill_pattern()`: touch buffers before timing (fresh pages run ~10x slower).
- `Stats`, `percentile()`, `aggregate_gib_s()`: timing arithmetic.
- `Row`, `print_table()`, `write_json()`, `machine_info()`: reporting.
- `start_s3()`: a throwaway Ceph radosgw on loopback, or moto_server when it cannot start (said so);
  `make_bucket()`, `raw_s3_get()`: a bucket there, raw GETs of every object in one.

Timestamps come from time.perf_counter() (CLOCK_MONOTONIC on Linux), which is system-wide, so
(start, end) pairs from several processes can be combined into one wall-clock window.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GIB = 1 << 30
MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


# -- daemon -------------------------------------------------------------------------------------


def kvstored_executable() -> str:
    """The venv's `kvstored` entry point next to this interpreter, else the one on PATH."""
    candidate = Path(sys.executable).with_name("kvstored")
    if candidate.exists():
        return str(candidate)
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = Path(d) / "kvstored"
        if p.exists():
            return str(p)
    raise FileNotFoundError("kvstored executable not found (run `make setup`)")


class Daemon:
    """A kvstored subprocess on a private temp socket. Use as a context manager.

    `env` adds to (not replaces) the environment, e.g. {"GLIBC_TUNABLES": "..."}.
    """

    def __init__(
        self,
        cpu_bytes: int,
        *,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.cpu_bytes = cpu_bytes
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.env = env or {}
        self.start_timeout_s = start_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstored-bench-")
        self.dir = Path(self._tmp.name)
        self.socket = self.dir / "kvstored.sock"
        self.log_path = self.dir / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        cmd = [
            *_die_with_parent(), kvstored_executable(), "serve",
            "--socket", str(self.socket),
            "--cpu-bytes", str(self.cpu_bytes),
            "--log-level", self.log_level,
            *self.extra_args,
        ]
        t0 = time.perf_counter()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True
        )
        try:
            wait_serving(self.socket, self.start_timeout_s, self.proc)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def cpu_seconds(self) -> float:
        """CPU seconds the daemon has used so far (all threads)."""
        return process_cpu_seconds(self.pid)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()  # our own child, by its pid
                    self.proc.wait()
            rc = self.proc.returncode
            self.proc = None
            self._log.close()
        with contextlib.suppress(Exception):
            self._tmp.cleanup()
        return rc

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _die_with_parent() -> list[str]:
    """A prefix for the daemon's command that SIGTERMs it when the benchmark dies, even by SIGKILL
    (the OOM killer picks the benchmark, which maps every daemon's pool), instead of leaving it
    running: util-linux's setpriv sets PR_SET_PDEATHSIG and execs it. Not a preexec_fn: that
    makes Popen fork() instead of vfork(), and gRPC's fork handlers then deadlock the benchmark."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM"] if setpriv else []


def wait_serving(socket_path: Path, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll grpc.health.v1.Health/Check on the socket until SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"kvstored exited with code {proc.returncode} during start-up")
        if socket_path.exists():
            with grpc.insecure_channel(f"unix:{socket_path}") as channel:
                try:
                    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError as exc:
                    last = exc
        time.sleep(0.05)
    raise TimeoutError(f"kvstored not SERVING on {socket_path} after {timeout_s}s ({last})")


def process_cpu_seconds(pid: int) -> float:
    """On-CPU seconds of all live threads of `pid`, in ns resolution (/proc/PID/task/*/schedstat);
    /proc/PID/stat counts in 10 ms ticks, too coarse for 100 ms phases. Falls back to it."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
        return total / 1e9
    except (FileNotFoundError, PermissionError):
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- buffers ------------------------------------------------------------------------------------


def populate(arr: np.ndarray) -> np.ndarray:
    """Write every page so that timed copies never take first-touch faults."""
    arr.view(np.uint8)[:: mmap.PAGESIZE] = 0
    arr.view(np.uint8)[-1:] = 0
    return arr


def fill_pattern(arr: np.ndarray, chunk_bytes: int, seed: int) -> None:
    """Distinct, cheap content per chunk (so a chunk landing in the wrong place is detected)."""
    flat = arr.view(np.uint8).reshape(-1)
    words = chunk_bytes // 8
    base = np.arange(words, dtype=np.uint64)
    for c in range(flat.shape[0] // chunk_bytes):
        tag = np.uint64(((seed & 0xFFFF) << 48) | (c << 24))
        np.bitwise_xor(base, tag, out=flat[c * chunk_bytes:(c + 1) * chunk_bytes].view(np.uint64))


class ShmFile:
    """A /dev/shm file of `size` bytes, mapped (MAP_POPULATE) and exposed as `.array` (uint8)."""

    def __init__(self, size: int, prefix: str = "kvstored-bench") -> None:
        self.size = size
        fd, path = tempfile.mkstemp(prefix=f"{prefix}-{os.getpid()}-", dir="/dev/shm")
        self.path = Path(path)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        populate(self.array)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        self.unlink()
        self.array = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()


# -- timing -------------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank-with-interpolation percentile (numpy's default 'linear')."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), p))


@dataclass
class Stats:
    best: float
    median: float
    worst: float
    samples: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, samples: Iterable[float], higher_is_better: bool = True) -> Stats:
        s = list(samples)
        hi, lo = max(s), min(s)
        return cls(hi if higher_is_better else lo, statistics.median(s), lo if higher_is_better else hi, s)


def aggregate_gib_s(total_bytes: int, windows: Sequence[tuple[float, float]]) -> float:
    """Aggregate throughput of processes that ran concurrently: bytes / (last end - first start)."""
    start = min(w[0] for w in windows)
    end = max(w[1] for w in windows)
    return total_bytes / (end - start) / GIB


# -- reporting ----------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    value: float
    unit: str  # "GiB/s" or "ms"
    baseline_name: str = ""
    baseline: float | None = None
    target: float | None = None  # ratio target
    higher_is_better: bool = True  # GiB/s: ratio >= target; latency: ratio <= target
    median: float | None = None
    note: str = ""
    limit: str = ""  # the physical limit the row is bounded by, in words (printed when given)

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline

    @property
    def status(self) -> str:
        if self.target is None or self.ratio is None:
            return ""
        ok = self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target
        return "PASS" if ok else "MISS"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["status"] = self.status or None
        return d


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return ""
    digits = 3 if unit == "ms" else 2
    return f"{v:.{digits}f} {unit}"


def print_aligned(table: Sequence[Sequence[str]], right: set[int], file=None) -> None:
    """A header row, a rule, then the rows; columns in `right` are right-aligned."""
    file = file or sys.stdout
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    print(line(table[0]), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in table[1:]:
        print(line(row), file=file)


def print_table(rows: Sequence[Row], title: str = "", file=None) -> None:
    file = file or sys.stdout
    limits = any(r.limit for r in rows)
    header = ["measurement", "value", "median", "baseline", "baseline value", "ratio", "target", "result"]
    table = [header + (["bounded by"] if limits else [])]
    for r in rows:
        cmp = ">=" if r.higher_is_better else "<="
        table.append([
            r.name,
            _fmt(r.value, r.unit),
            _fmt(r.median, r.unit),
            r.baseline_name,
            _fmt(r.baseline, r.unit),
            f"{r.ratio:.2f}x" if r.ratio is not None else "",
            f"{cmp} {r.target:.2f}x" if r.target is not None else "",
            r.status,
        ] + ([r.limit] if limits else []))
    if title:
        print(title, file=file)
    print_aligned(table, right={1, 2, 4, 5}, file=file)
    notes = [r for r in rows if r.note]
    for r in notes:
        print(f"  * {r.name}: {r.note}", file=file)


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import grpc

    return {
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "glibc": "-".join(platform.libc_ver()),
        "numpy": np.__version__,
        "grpcio": grpc.__version__,
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "git": git_revision(),
        "glibc_non_temporal_threshold": glibc_non_temporal_threshold(),
    }


def glibc_non_temporal_threshold() -> int | None:
    """glibc's memcpy size from which it uses non-temporal (cache-bypassing) stores, as this
    process sees it (GLIBC_TUNABLES included); None if ld.so cannot list its tunables. It is
    derived from the L3 size the CPU reports: copies below it run ~2x slower on this VM."""
    for ld in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"):
        if not os.path.exists(ld):
            continue
        try:
            out = subprocess.run([ld, "--list-tunables"], capture_output=True, text=True, timeout=5,
                                 env=os.environ.copy()).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.splitlines():
            if line.startswith("glibc.cpu.x86_non_temporal_threshold:"):
                return int(line.split(":", 1)[1].split()[0], 16)
    return None


def git_revision() -> str:
    """HEAD of the checkout, with '+dirty' when tracked files differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def load_average() -> float:
    """1-minute load average: above ~1 on an idle machine, other work is competing for the CPUs."""
    return os.getloadavg()[0]


def write_json(path: str | os.PathLike, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


# -- physical limits (what a path is bounded by on this machine) --------------------------------


def drop_page_cache(level: int = 3) -> bool:
    """sync, then drop the page cache (1) or also dentries and inodes (3); root only."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write(f"{level}\n")
        return True
    except OSError:
        return False


def aligned_pool(nbytes: int) -> mmap.mmap:
    """A populated anonymous mapping: page-aligned, as O_DIRECT needs and as the daemon's pool is."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, nbytes, flags=flags)
    populate(np.frombuffer(buf, dtype=np.uint8))
    return buf


def memcpy_gib_s(nbytes: int = 256 * MIB, repeat: int = 3) -> float:
    """One large numpy copy between two populated buffers (glibc uses non-temporal stores at this
    size): the memory-bandwidth ceiling of one core, best of `repeat`."""
    src = populate(np.empty(nbytes, dtype=np.uint8))
    dst = populate(np.empty(nbytes, dtype=np.uint8))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GIB


@dataclass(frozen=True)
class DiskLimit:
    """Raw O_DIRECT of one file per chunk (header page + payload, as the fs tier writes them)."""

    write_gib_s: float
    read_gib_s: float  # page cache dropped first (when root); O_DIRECT reads bypass it anyway
    queue_depth: int
    chunk_bytes: int


def raw_odirect(directory: str | os.PathLike, chunks: int, chunk_bytes: int, queue_depth: int) -> DiskLimit:
    """Write then read `chunks` files of 4 KiB + chunk_bytes with O_DIRECT from `queue_depth`
    threads (as many I/Os at the disk at once as the tier under test has), on the same disk."""
    root = Path(tempfile.mkdtemp(prefix="kvstored-raw-odirect-", dir=directory))
    buf = aligned_pool(4096 + chunk_bytes)
    view = memoryview(buf)
    paths = [str(root / f"{i:06d}.raw") for i in range(chunks)]
    local = threading.local()

    def write(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        try:
            if os.pwritev(fd, [view], 0) != len(view):
                raise RuntimeError("short O_DIRECT write")
        finally:
            os.close(fd)

    def read(path: str) -> None:
        mine = getattr(local, "buf", None)
        if mine is None:
            mine = local.buf = memoryview(aligned_pool(len(view)))
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            if os.preadv(fd, [mine], 0) != len(mine):
                raise RuntimeError("short O_DIRECT read")
        finally:
            os.close(fd)

    try:
        with ThreadPoolExecutor(queue_depth) as pool:
            os.sync()
            t0 = time.perf_counter()
            list(pool.map(write, paths))
            w = time.perf_counter() - t0
            drop_page_cache()
            t0 = time.perf_counter()
            list(pool.map(read, paths))
            r = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = chunks * chunk_bytes
    return DiskLimit(total / w / GIB, total / r / GIB, queue_depth, chunk_bytes)


@dataclass
class S3Started:
    """An S3 server on loopback (tests/support/s3.py): `kind` "rgw" or "moto"; `note` says why it
    is moto when radosgw was asked for."""

    kind: str
    endpoint: Any  # tests.support.s3.S3Endpoint: url, keys, region, client_kwargs()
    note: str
    server: Any

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.stop()


def start_s3(kind: str, memstore_bytes: int) -> S3Started:
    """radosgw with a memstore OSD of `memstore_bytes` (RAM), falling back to moto_server (kind
    "rgw"); or moto_server alone (kind "moto"). RuntimeError if neither starts."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.support.s3 import MotoServer, RadosGW

    errors = []
    for k in (["rgw", "moto"] if kind == "rgw" else ["moto"]):
        server = RadosGW(memstore_bytes=memstore_bytes) if k == "rgw" else MotoServer()
        try:
            endpoint = server.start()
        except Exception as exc:  # noqa: BLE001 - fall back, then report
            text = str(exc).strip()
            errors.append(f"{k}: {text.splitlines()[0] if text else repr(exc)}")
            with contextlib.suppress(Exception):
                server.stop()
            continue
        note = ("S3: radosgw did NOT start (" + "; ".join(errors) + "); the S3 figures are against moto_server "
                "(Python, in RAM), not a real S3 server") if errors else ""
        return S3Started(k, endpoint, note, server)
    raise RuntimeError("no S3 server: " + "; ".join(errors))


def make_bucket(endpoint: Any, bucket: str) -> None:
    import asyncio

    from aiobotocore.session import get_session

    async def create() -> None:
        async with get_session().create_client("s3", **endpoint.client_kwargs()) as client:
            await client.create_bucket(Bucket=bucket)

    asyncio.run(create())


def raw_s3_get(endpoint: Any, bucket: str, inflight: int) -> tuple[float, float]:
    """GET every object of the bucket, `inflight` at a time, bodies read and dropped (aiobotocore,
    as the S3 tier uses it): (GiB/s, this process's CPU s/GiB), from the first GET to the last."""
    import asyncio

    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(max_pool_connections=inflight, retries={"total_max_attempts": 1},
                       s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                       response_checksum_validation="when_required")

    async def run() -> tuple[float, float]:
        async with get_session().create_client("s3", config=config, **endpoint.client_kwargs()) as client:
            names = []
            async for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                names += [o["Key"] for o in page.get("Contents", [])]
            slots = asyncio.Semaphore(inflight)
            total = 0

            async def get(name: str) -> None:
                nonlocal total
                async with slots:
                    response = await client.get_object(Bucket=bucket, Key=name)
                    async with response["Body"] as stream:
                        body = await stream.read()
                total += len(body)  # (not `total += await ...`: that reads `total` before the await)

            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(get(n) for n in names))
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            gib = total / GIB
            return gib / wall, cpu / gib

    return asyncio.run(run())
