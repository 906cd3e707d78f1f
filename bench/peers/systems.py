# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The coordinator's side: start a system's server (a failure is kept, with why, for the report),
run its client processes (bench.peers.worker in the system's venv) and send them commands."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib.daemons import cpu_of
from bench.lib.report import REPO
from bench.peers.worker import Server


class WorkerProcess:
    """One client process; call() sends a command and waits for its answer."""

    def __init__(self, system: str, server: Server, cfg: dict[str, Any], log_dir: Path) -> None:
        python = str(server.python or sys.executable)
        self.log_path = Path(tempfile.mkstemp(prefix=f"worker-{system}-", suffix=".log", dir=log_dir)[1])
        self.proc = subprocess.Popen(
            [python, "-m", "bench.peers.worker", system, json.dumps({**server.config, **cfg})],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log_path, "wb"),
            text=True,
            env={**os.environ, **server.env, "PYTHONPATH": _pythonpath()},
        )
        self._read()  # the driver is up
        self.pid = self.proc.pid

    def _read(self) -> dict[str, Any]:
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
        return self._read()

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
    max_procs: int
    server: Server | None = None
    error: str = ""
    workers: list[WorkerProcess] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, label: str, max_procs: int, starter: Callable[[], Server]) -> System:
        sys_ = cls(name, label, max_procs)
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


def _pythonpath() -> str:
    """The repository first (bench.peers.worker), then what the caller had: a worktree's client
    on it must win over an editable install of another checkout's."""
    return os.pathsep.join([str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)])
