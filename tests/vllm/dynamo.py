# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Dynamo 1.6.1 as the router tests see it: its standalone KV indexer following the daemon under
test (tests/support/dynamo.py starts it), and its deployment path's KvRouter (dynamo_kvrouter.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import dynamo as support

REPO = Path(__file__).resolve().parents[2]


def dynamo_python() -> Path:
    try:
        return support.dynamo_python()
    except support.DynamoMissing as exc:
        pytest.fail(str(exc))


class DynamoIndexer:
    """Dynamo's indexer following one worker (the daemon under test), as its router would."""

    def __init__(self, worker_endpoint: str, model: str, block_size: int, log: Path, worker_id: int = 7) -> None:
        dynamo_python()
        self.worker_id = worker_id
        self._indexer = support.DynamoIndexer({worker_id: worker_endpoint}, block_size, log, model)

    def dump(self) -> Any:
        return self._indexer.dump()

    def overlap(self, token_ids: list[int]) -> dict[str, int]:
        """The worker's matched tokens per tier ({} when the router knows nothing of it)."""
        return self._indexer.scores(token_ids).get(self.worker_id, {})

    def stop(self) -> None:
        self._indexer.stop()


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
        support.reap(self._proc)
        self._log.close()
