# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Dynamo 1.6.1's standalone KV indexer (its own venv, tests/vllm/install_dynamo.sh) as a router
process: it subscribes to workers' ZMQ streams with Dynamo's own decoder and answers /query.
Started by the router tests (tests/vllm/) and by `bench.multiturn --route kv`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.support.ports import free_port

INSTALL_HINT = "Dynamo's router is not installed: run tests/vllm/install_dynamo.sh (make vllm-deps does)"
UP_S = 60.0  # a bound for the indexer to answer, never a measurement
_RUN = "import sys, dynamo._core as c; c.run_kv_indexer(sys.argv[1:])"


class DynamoMissing(RuntimeError):
    pass


def dynamo_python() -> Path:
    """The Python of Dynamo's venv; DynamoMissing (saying how to install it) when there is none."""
    python = Path(sys.prefix) / "dynamo-1.6.1" / "bin" / "python"
    if not python.exists():
        raise DynamoMissing(f"{INSTALL_HINT} ({python})")
    return python


class DynamoIndexer:
    """The indexer following `workers` (worker id -> ZMQ endpoint); `model` None: Dynamo's default."""

    def __init__(self, workers: Mapping[int, str], block_size: int, log: Path, model: str | None = None) -> None:
        python = dynamo_python()
        self.port = free_port()
        self.model = model or "default"
        args = ["--port", str(self.port), "--block-size", str(block_size), "--threads", "1"]
        args += ["--model-name", model] if model else []
        args += ["--workers", ",".join(f"{i}={e}" for i, e in workers.items())]
        self._log = open(log, "w")  # noqa: SIM115  (closed in stop)
        # -P: a dynamo.py on the caller's path (this one) must not shadow Dynamo's package
        self._proc = subprocess.Popen(
            [str(python), "-P", "-c", _RUN, *args], stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + UP_S
        while not self._up():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Dynamo's indexer did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.1)

    def _post(self, path: str, body: Any) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def _up(self) -> bool:
        try:
            self.dump()
            return True
        except OSError:
            return False

    def dump(self) -> Any:
        return self._post("/dump", None)

    def scores(self, token_ids: list[int]) -> dict[int, dict[str, int]]:
        """Worker id -> its matched tokens per tier and `longest_matched` (workers it knows of)."""
        answer = self._post("/query", {"token_ids": token_ids, "model_name": self.model})
        return {int(k): v for k, v in answer.get("instances", {}).items()}

    def stop(self) -> None:
        self._proc.terminate()
        reap(self._proc)
        self._log.close()


def reap(proc: subprocess.Popen) -> None:
    """Wait for a process asked to end; killed if it has not within 10 s."""
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
