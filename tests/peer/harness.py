# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Running tests.peer.node processes from a test: start them (in a namespace or not), read their
JSON-line events, wait for an event with a bound, signal them, stop them."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.support.netns import Node

REPO_ROOT = Path(__file__).resolve().parents[2]
EVENT_TIMEOUT_S = 60.0  # a bound, not a measurement: every wait fails loudly instead of hanging

Event = dict
Pred = Callable[[Event], bool]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "client")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class NodeProcess:
    def __init__(self, args: Sequence[str], node: Node | None = None, name: str = "node") -> None:
        argv = [sys.executable, "-X", "faulthandler", "-m", "tests.peer.node", *args]
        self.name = name
        self.argv = node.exec(argv) if node is not None else argv
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(),
            cwd=REPO_ROOT,
            text=True,
        )
        self.events: list[Event] = []
        self._queue: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.ready = self.wait(lambda e: e["event"] == "ready")

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._queue.put(json.loads(line))
            except json.JSONDecodeError:
                self._stderr.append(f"(stdout) {line}")
        self._queue.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def describe(self) -> str:
        tail = "".join(self._stderr[-40:])
        return f"{self.name} ({' '.join(self.argv[-12:])}), exit {self.proc.poll()}:\n{tail}"

    def wait(self, pred: Pred, after: int = 0, timeout: float = EVENT_TIMEOUT_S) -> Event:
        """The first event at index >= `after` matching `pred` (events seen so far included)."""
        for e in self.events[after:]:
            if pred(e):
                return e
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no matching event within {timeout:.0f} s from {self.describe()}")
            try:
                e = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if e is None:
                self._queue.put(None)  # keep reporting the end
                raise AssertionError(f"{self.name} ended before the event: {self.describe()}")
            self.events.append(e)
            if len(self.events) > after and pred(e):
                return e

    def command(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def exit_code(self, timeout: float = EVENT_TIMEOUT_S) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.wait(EVENT_TIMEOUT_S)


class ServerNode(NodeProcess):
    def __init__(
        self,
        transport: str,
        node: Node | None,
        *,
        chunks: int,
        data_port: int = 0,
        control_port: int = 0,
        extra: Sequence[str] = (),
    ) -> None:
        host = node.ip if node is not None else "127.0.0.1"
        args = [
            "serve",
            "--transport",
            transport,
            "--chunks",
            str(chunks),
            "--host",
            host,
            "--data-port",
            str(data_port),
            "--control-port",
            str(control_port),
            "--ucx-net-devices",
            ucx_devices(node),
            *extra,
        ]
        super().__init__(args, node, name=f"{transport} server")
        self.host = host
        self.data_port = self.ready["data_port"]
        self.control_port = self.ready["control_port"]

    def stats(self) -> Event:
        mark = len(self.events)
        self.command("stats")
        return self.wait(lambda e: e["event"] == "stats", after=mark)

    def wait_stats(self, pred: Pred, what: str, timeout: float = EVENT_TIMEOUT_S) -> Event:
        """Stats once `pred` holds (polled, bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if pred(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"server never {what}: {s}")
            time.sleep(0.05)

    def wait_settled(self) -> Event:
        """Stats once no lease is held and nothing is quarantined."""
        return self.wait_stats(lambda s: s["leased"] == 0 and s["quarantined"] == 0, "settled")

    def stop(self) -> int:
        self.command("stop")
        return self.exit_code()


class FetchNode(NodeProcess):
    def __init__(
        self,
        transport: str,
        node: Node | None,
        server: ServerNode,
        *,
        chunks: int,
        once: bool,
        extra: Sequence[str] = (),
    ) -> None:
        args = [
            "fetch",
            "--transport",
            transport,
            "--chunks",
            str(chunks),
            "--data",
            f"{server.host}:{server.data_port}",
            "--control",
            f"{server.host}:{server.control_port}",
            "--ucx-net-devices",
            ucx_devices(node),
            *(["--once"] if once else []),
            *extra,
        ]
        super().__init__(args, node, name=f"{transport} fetcher")

    def received(self, at_least: int, after: int = 0) -> Event:
        return self.wait(lambda e: e["event"] == "progress" and e["received"] >= at_least, after=after)

    def failure(self, after: int = 0) -> Event:
        return self.wait(
            lambda e: e["event"] in ("result", "exception") and e.get("outcome") != "received", after=after
        )

    def summary(self) -> Event:
        return self.wait(lambda e: e["event"] == "summary")

    def stop(self) -> Event:
        self.command("stop")
        return self.summary()


def ucx_devices(node: Node | None) -> str:
    return "eth0" if node is not None else "lo"


def failures(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if e["event"] in ("result", "exception") and e.get("outcome") != "received"]
