# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Real kvstored daemons for the benchmarks: tests/support/daemon.py's Daemon (one launcher for tests
and benchmarks), with what a benchmark reads off it: start-up time, CPU seconds, the exit code."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from tests.support.daemon import REPO_ROOT as REPO
from tests.support.daemon import Daemon as _Daemon
from tests.support.ports import free_port

__all__ = ["REPO", "Daemon", "cpu_of", "free_port", "process_cpu_seconds", "stop_process"]


def _die_with_parent(argv: list[str]) -> list[str]:
    """SIGTERM the daemon when the benchmark dies, even by SIGKILL (the OOM killer picks the
    benchmark, which maps every pool): setpriv sets PR_SET_PDEATHSIG and execs it. Not a
    preexec_fn: that makes Popen fork() instead of vfork(), and gRPC's fork handlers deadlock."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *argv] if setpriv else argv


class Daemon:
    """`kvstored serve` with `cpu_bytes` of RAM on a private socket; `env` adds to the environment.
    A context manager; stop() returns the exit code instead of asserting it."""

    def __init__(
        self,
        cpu_bytes: int | str,
        *,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 60.0,
        socket: os.PathLike | None = None,  # several daemons on one socket, one after the other (a restart)
    ) -> None:
        self._d = _Daemon(socket, cpu_bytes=str(cpu_bytes), wrap=_die_with_parent)
        self.args = ["--log-level", log_level, *extra_args]
        self.env = {**os.environ, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.socket = self._d.socket
        self.start_s = 0.0
        self._tail = ""

    @property
    def pid(self) -> int:
        return self._d.pid

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.perf_counter()
        self.spawn()
        self.wait_ready()
        self.start_s = time.perf_counter() - t0

    def spawn(self) -> None:  # not waiting for it to serve (wait_ready() does)
        self._d.spawn(self.args, self.env)

    def wait_ready(self) -> None:
        try:
            self._d.wait_ready(self.start_timeout_s)
        except AssertionError as exc:  # tests' DaemonError: its first line (the log is in log_tail)
            self.stop()
            raise RuntimeError(str(exc).splitlines()[0]) from None

    def wait(self, timeout_s: float = 60.0) -> int:  # for the process to exit by itself: its exit code
        return self._d.wait(timeout_s)

    @property
    def log(self) -> str:  # everything the current (or last) process wrote
        return self._d.log

    def stats(self) -> Any:  # kvstored.v1.KVStore/Stats
        return self._d.stats()

    def peer_status(self) -> Any:
        """kvstored.v1.Peer/Status: this daemon's view of its peers."""
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

        with self._d.channel() as channel:
            return pb_grpc.PeerStub(channel).Status(pb.PeerStatusRequest(), timeout=10)

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        rc = None
        if self._d.proc is not None:
            with contextlib.suppress(AssertionError):  # killed after the timeout: its code stays
                self._d.terminate(timeout_s)
            rc = self._d.returncode
            self._tail = self.log_tail()
            self._d.proc = None
        self._d.cleanup()
        return rc

    def log_tail(self, n: int = 40) -> str:
        return "\n".join((self._d.log if self._d.proc is not None else self._tail).splitlines()[-n:])


def rss_anon(pid: int, field: str = "RssAnon") -> int:
    """Anonymous resident memory of `pid` in bytes (the heap, not the shared pool), or another `field`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def process_cpu_seconds(pid: int) -> float:
    """On-CPU seconds of all live threads of `pid` in ns (/proc/PID/task/*/schedstat): /proc/PID/stat
    counts 10 ms ticks, too coarse for 100 ms phases; it is the fallback."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
        return total / 1e9
    except (FileNotFoundError, PermissionError):
        return stat_cpu_seconds([pid])


def stat_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds of processes, exited threads included (/proc/PID/stat; 10 ms ticks)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def cpu_of(pids: Sequence[int]) -> float:
    return sum(process_cpu_seconds(p) for p in pids)


def spawn_logged(argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """A server process in a session of its own, run in `log`'s directory, its output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent, start_new_session=True
        )


def stop_process(proc: subprocess.Popen, timeout_s: float, group: bool = False) -> None:
    """SIGTERM a child of ours (`group`: its whole process group), SIGKILL after `timeout_s`; reaped."""
    if proc.poll() is not None:
        return
    send = partial(os.killpg, proc.pid) if group else proc.send_signal
    send(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


def wait_listening(port: int, proc: subprocess.Popen, log: Path, what: str, timeout_s: float) -> None:
    """Until `proc` listens on 127.0.0.1:`port`; RuntimeError with the end of its `log` if it exits or times out."""
    from tests.support.s3 import wait_for_port  # (that module imports aiohttp and pytest)

    try:
        wait_for_port(port, timeout_s, alive=lambda: proc.poll() is None)
    except RuntimeError as exc:
        raise RuntimeError(f"{what} did not start ({exc}): {log.read_text(errors='replace')[-300:]}") from None
