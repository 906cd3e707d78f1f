# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Run a real kvstored daemon as a subprocess on a unix socket, for tests of any tier.

    d = Daemon(cpu_bytes="16MiB").start()
    ... d.socket, d.session_socket, d.client(), d.stub(), d.log ...
    d.stop()          # SIGTERM; asserts exit code 0 and that both socket files are gone

`start()` returns only once the daemon answers the gRPC health check with SERVING (or raises
with the daemon's log if it exits or never gets there).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


def short_tmpdir(prefix: str = "kv") -> Path:
    """A fresh directory whose paths stay far below the 108-byte unix socket path limit."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def kvstored_command() -> list[str]:
    """The console script of the venv the tests run in (falls back to `python -m kvstored`)."""
    script = Path(sys.executable).parent / "kvstored"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "kvstored"]


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process' environment without KVSTORED_* (so a developer's settings don't leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORED_")}
    env.pop("NOTIFY_SOCKET", None)
    env.update(extra or {})
    return env


# What systemd does when it starts a service with fds (socket activation, the fd store): the fds
# from 3 on, LISTEN_FDS / LISTEN_FDNAMES naming them and LISTEN_PID the process, which exec keeps.
_LISTEN_FDS_EXEC = """
import os, sys
names, fds, argv = sys.argv[1].split(":"), [int(x) for x in sys.argv[2].split(",")], sys.argv[3:]
import fcntl
high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(fds)) for fd in fds]  # (clear of the targets)
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i, inheritable=True)
os.environ.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=":".join(names), LISTEN_PID=str(os.getpid()))
os.execv(argv[0], argv)
"""


class DaemonError(AssertionError):
    pass


def stop_all(daemons: Iterable[Daemon]) -> list[str]:
    """SIGTERM every daemon still running (each must exit cleanly), clean up all of them; returns
    the teardown failures for the fixture to report."""
    errors = []
    for d in daemons:
        try:
            if d.running:
                d.stop()
        except DaemonError as exc:
            errors.append(str(exc))
        finally:
            d.cleanup()
    return errors


class Daemon:
    def __init__(
        self,
        socket: str | os.PathLike | None = None,
        *,
        workdir: str | os.PathLike | None = None,
        cpu_bytes: str = "16MiB",
        page_bytes: str | None = None,
        populate: bool = True,
        wrap: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        self._wrap = wrap  # e.g. run it in a network namespace: Node.exec
        self.workdir = Path(workdir) if workdir else short_tmpdir()
        self._own_workdir = workdir is None
        self.socket = Path(socket) if socket else self.workdir / "kv.sock"
        if len(str(self.socket)) + len(".session") >= 100:
            raise ValueError(f"socket path too long for a unix socket: {self.socket}")
        self.base_args = [
            "serve",
            "--socket",
            str(self.socket),
            "--cpu-bytes",
            cpu_bytes,
            "--populate",
            "true" if populate else "false",
            "--metrics-addr",
            "off",  # several test daemons at once must not fight over a port
        ]
        if page_bytes is not None:  # otherwise the daemon's default (64 KiB) or its config sources
            self.base_args += ["--page-bytes", page_bytes]
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.log_path: Path | None = None
        self._starts = 0

    # -- properties ---------------------------------------------------------------------------

    @property
    def session_socket(self) -> Path:
        return Path(f"{self.socket}.session")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log(self) -> str:
        """Everything the current (or last) daemon process wrote to stdout/stderr."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    # -- lifecycle ----------------------------------------------------------------------------

    def spawn(
        self,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        listen_fds: Mapping[str, int] | None = None,
    ) -> subprocess.Popen:
        """Start the process without waiting for readiness (for tests that expect it to fail).
        `listen_fds`: fds by name, passed as systemd passes them (LISTEN_FDS from fd 3)."""
        if self.running:
            raise DaemonError("daemon already running")
        self._starts += 1
        self.log_path = self.workdir / f"daemon-{self._starts}.log"
        log = open(self.log_path, "wb")
        try:
            argv = kvstored_command() + self.base_args + list(extra_args)
            if listen_fds:
                names, fds = ":".join(listen_fds), ",".join(map(str, listen_fds.values()))
                argv = [sys.executable, "-c", _LISTEN_FDS_EXEC, names, fds, *argv]
            self.proc = subprocess.Popen(
                self._wrap(argv) if self._wrap else argv,
                pass_fds=tuple(listen_fds.values()) if listen_fds else (),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=clean_env(env),
                cwd=REPO_ROOT,
            )
        finally:
            log.close()
        self.returncode = None
        return self.proc

    def start(
        self, extra_args: Iterable[str] = (), env: Mapping[str, str] | None = None, timeout: float = READY_TIMEOUT_S
    ) -> Daemon:
        self.spawn(extra_args, env)
        try:
            self.wait_ready(timeout)
        except BaseException:
            if self.running:
                self.kill()
            raise
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Poll the health service until it says SERVING and the session socket exists."""
        deadline = time.monotonic() + timeout

        def check_alive() -> None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                raise DaemonError(f"kvstored exited with {self.proc.returncode} while starting:\n{self.log}")
            if time.monotonic() > deadline:
                raise DaemonError(f"kvstored not ready after {timeout}s:\n{self.log}")

        # The session socket appears once the gRPC server runs; polling the file first keeps the
        # channel below from sitting in gRPC's reconnect backoff while the daemon imports.
        while not self.session_socket.exists():
            check_alive()
            time.sleep(0.02)
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                check_alive()
                try:
                    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0, wait_for_ready=True)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.02)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        assert self.proc is not None
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise DaemonError(f"kvstored (pid {self.proc.pid}) did not exit within {timeout}s:\n{self.log}") from None
        return self.returncode

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait; returns the exit code (no checks)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM; assert a clean exit (code 0) and that both socket files were removed."""
        rc = self.terminate(timeout)
        if rc != 0:
            raise DaemonError(f"kvstored exited with {rc} after SIGTERM (expected 0):\n{self.log}")
        left = [p for p in (self.socket, self.session_socket) if p.exists()]
        if left:
            raise DaemonError(f"kvstored left socket files behind after SIGTERM: {left}\n{self.log}")

    def kill(self) -> None:
        """SIGKILL (socket files stay behind, as after a crash)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        self.returncode = self.proc.wait(STOP_TIMEOUT_S)

    def cleanup(self) -> None:
        """Kill a daemon still running and remove the work directory (only one we created)."""
        if self.running:
            self.kill()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- talking to it ------------------------------------------------------------------------

    def client(self, **kwargs):
        from kvstored_client import Client

        kwargs.setdefault("deadline_s", 10.0)
        return Client(self.socket, **kwargs)

    def async_client(self, **kwargs):
        from kvstored_client import AsyncClient

        kwargs.setdefault("deadline_s", 10.0)
        return AsyncClient(self.socket, **kwargs)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def stats(self):
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
        from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

        with self.channel() as channel:
            return pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=10)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"Daemon(socket={str(self.socket)!r}, pid={self.proc.pid if self.proc else None})"
