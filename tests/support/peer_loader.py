# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A client of one daemon that keeps loading chunks another daemon holds, in a thread: each round
loads a batch, checks it byte for byte, then deletes it on its own daemon (a local delete), so
the next round of the same keys fetches from the peer again. It records what every load did."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from tests.support.data import payloads

BATCH = 2


@dataclass
class LoaderLog:
    full: int = 0  # loads that got every chunk of their batch
    partial: int = 0  # some
    missed: int = 0  # none: misses
    wrong: int = 0  # chunks whose bytes were not the key's payload
    exceptions: list[str] = field(default_factory=list)

    @property
    def loads(self) -> int:
        return self.full + self.partial + self.missed


class PeerLoader:
    def __init__(self, daemon, ns_fields: dict, keys: list[bytes], chunk_bytes: int, deadline_s: float = 3.0) -> None:
        self._daemon = daemon
        self._fields = ns_fields
        self._keys = keys
        self._chunk = chunk_bytes
        self._deadline_s = deadline_s
        self.log = LoaderLog()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-loader", daemon=True)

    def __enter__(self) -> PeerLoader:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def snapshot(self) -> LoaderLog:
        with self._lock:
            return LoaderLog(
                self.log.full, self.log.partial, self.log.missed, self.log.wrong, list(self.log.exceptions)
            )

    def stop(self, timeout: float = 60.0) -> LoaderLog:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the loader is stuck in a call: a hang"
        return self.snapshot()

    def _run(self) -> None:
        try:
            with self._daemon.client(deadline_s=self._deadline_s) as kv:
                ns = kv.register_namespace(**self._fields)
                out = np.empty((BATCH, self._chunk), np.uint8)
                i = 0
                while not self._stop.is_set():
                    batch = [self._keys[(i + j) % len(self._keys)] for j in range(BATCH)]
                    i += BATCH
                    try:
                        loaded = kv.load(ns, batch, out)
                        wrong = sum(
                            1
                            for row in range(loaded)
                            if not np.array_equal(out[row], payloads(batch[row : row + 1], self._chunk)[0])
                        )
                        if loaded:
                            kv.delete(ns, batch[:loaded])  # this daemon only: the peer keeps its copy
                    except Exception as exc:  # the contract says a load never raises: record it
                        with self._lock:
                            self.log.exceptions.append(f"{type(exc).__name__}: {exc}")
                        continue
                    with self._lock:
                        self.log.wrong += wrong
                        if loaded == len(batch):
                            self.log.full += 1
                        elif loaded:
                            self.log.partial += 1
                        else:
                            self.log.missed += 1
        except Exception as exc:
            with self._lock:
                self.log.exceptions.append(f"{type(exc).__name__}: {exc}")
