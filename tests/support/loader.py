# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A client thread that loads chunks in a loop and checks every byte against the payload its key
stands for (tests.support.data.payload): the fault tests' witness that nobody got wrong bytes."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from tests.support.data import payloads


@dataclass
class LoaderCounts:
    loads: int = 0
    chunks: int = 0
    wrong_bytes: int = 0  # chunks whose bytes differed from their key's payload
    short: int = 0  # loads that returned fewer chunks than asked


class VerifyingLoader:
    """Loads random batches of `keys` (all stored beforehand) until stopped."""

    def __init__(self, daemon, model: str, chunk: int, keys: list[bytes], batch: int = 4, seed: int = 7) -> None:
        self.counts = LoaderCounts()
        self._daemon, self._model, self._chunk, self._keys, self._batch = daemon, model, chunk, keys, batch
        self._rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        expected = payloads(self._keys, self._chunk)
        try:
            with self._daemon.client(deadline_s=30.0) as c:
                ns = c.register_namespace(model=self._model, dtype="uint8", chunk_bytes=self._chunk)
                while not self._stop.is_set():
                    picks = self._rng.choice(len(self._keys), self._batch, replace=False)
                    out = np.zeros((self._batch, self._chunk), np.uint8)
                    loaded = c.load(ns, [self._keys[i] for i in picks], out)
                    self.counts.loads += 1
                    self.counts.chunks += loaded
                    self.counts.short += loaded < self._batch
                    self.counts.wrong_bytes += sum(
                        not np.array_equal(out[j], expected[i]) for j, i in enumerate(picks[:loaded])
                    )
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self._error = exc

    def stop(self) -> LoaderCounts:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the loader hung"
        if self._error is not None:
            raise AssertionError(f"the loader failed: {self._error!r}") from self._error
        return self.counts
