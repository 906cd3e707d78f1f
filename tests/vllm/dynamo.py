# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Dynamo 1.6.1's standalone KV indexer (its own venv, install_dynamo.sh) as a router process:
it subscribes to a worker's ZMQ stream with Dynamo's own decoder and answers /query."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.wait import wait_for
from tests.support.zmq_events import free_port

REPO = Path(__file__).resolve().parents[2]
INSTALL_HINT = "Dynamo's router is not installed: run tests/vllm/install_dynamo.sh (make vllm-deps does)"
_RUN = "import sys, dynamo._core as c; c.run_kv_indexer(sys.argv[1:])"


def dynamo_python() -> Path:
    python = Path(sys.prefix) / "dynamo-1.6.1" / "bin" / "python"
    if not python.exists():
        pytest.fail(INSTALL_HINT)
    return python


class DynamoIndexer:
    def __init__(self, worker_endpoint: str, model: str, block_size: int, log: Path, worker_id: int = 7) -> None:
        self.port = free_port()
        self.model = model
        self.worker_id = str(worker_id)
        args = ["--port", str(self.port), "--block-size", str(block_size), "--model-name", model, "--threads", "1"]
        args += ["--workers", f"{worker_id}={worker_endpoint}"]
        self._log = open(log, "w")  # noqa: SIM115  (closed in stop)
        self._proc = subprocess.Popen(
            [str(dynamo_python()), "-c", _RUN, *args], stdout=self._log, stderr=subprocess.STDOUT
        )
        assert wait_for(self._up, 30), f"Dynamo's indexer did not come up: {log.read_text()[-2000:]}"

    def _up(self) -> bool:
        try:
            self.dump()
            return True
        except OSError:
            return False

    def _post(self, path: str, body: Any) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def dump(self) -> Any:
        return self._post("/dump", None)

    def overlap(self, token_ids: list[int]) -> dict[str, int]:
        """The worker's matched tokens per tier ({} when the router knows nothing of it)."""
        scores = self._post("/query", {"token_ids": token_ids, "model_name": self.model})
        return scores.get("instances", {}).get(self.worker_id, {})

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)
        self._log.close()


class DynamoKvRouter:
    """Dynamo's deployment path (dynamo_kvrouter.py in Dynamo's venv): a worker registered with
    in-memory discovery and the ZMQ event plane relays the daemon's stream through
    KvEventPublisher(zmq_endpoint=...); a KvRouter over it answers get_overlap_scores."""

    def __init__(self, worker_endpoint: str, model: str, block_size: int, log: Path) -> None:
        self._log = open(log, "w")  # noqa: SIM115  (closed in stop)
        script = Path(__file__).with_name("dynamo_kvrouter.py")
        self._proc = subprocess.Popen(  # -P: this folder's dynamo.py must not shadow Dynamo's package
            [str(dynamo_python()), "-P", str(script), worker_endpoint, model, str(block_size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        ready = self._read()
        self.worker_id = ready["ready"][0]

    def _read(self) -> Any:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        assert line, f"Dynamo's KvRouter exited: {Path(self._log.name).read_text()[-2000:]}"
        return json.loads(line)

    def overlap(self, token_ids: list[int]) -> dict[str, int]:
        """The worker's row of get_overlap_scores, in blocks per tier ({} when it is not listed)."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"token_ids": token_ids}) + "\n")
        self._proc.stdin.flush()
        rows = self._read()["workers"]
        return next((row for row in rows if row["worker_id"] == self.worker_id), {})

    def stop(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._log.close()
