# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The daemon killed (SIGKILL) while it copies a region transfer, and restarted at once (as
systemd would): the client must say the outcome is unknown (TransferOutcomeUnknown), never
"nothing loaded" / "dropped" while bytes moved, and must not send the transfer again to the new
daemon (whose answer would describe the second try, not the bytes the first one moved).

A watcher thread sees the copy's first bytes land (in the client's region for a load, in the
daemon's pool for a store), kills the daemon at once (the rest of the 128 MiB batch is still
being copied then) and starts a new one on the same socket. Each attempt uses a fresh daemon;
attempts go on until a kill has landed mid-copy (bounded). Sync and async clients alike; the
same client then works with the new daemon.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstored_client import StoreResult
from kvstored_client.errors import TransferOutcomeUnknown
from tests.support.daemon import Daemon
from tests.support.data import make_keys, payloads
from tests.support.rpc import raw

CHUNK = 1 << 20
N = 128  # a 128 MiB batch: the copy takes some ms, much longer than a kill takes to land
ATTEMPTS = 8
UNTOUCHED = 0xA5


@dataclass
class Attempt:
    outcome: object  # the call's return value, or the exception it raised
    followup: object  # the same client's next transfer (one chunk), against the new daemon
    changed: int  # chunks of the region that changed (loads)
    mid_copy: bool  # the kill landed while the copy was under way


class Killer:
    """Kills the daemon as soon as `view` (the copy's first destination bytes) stops being all
    its initial value, then starts a new one on the same socket; `fired` says whether it did."""

    def __init__(self, view: np.ndarray, daemon: Daemon) -> None:
        self._view, self._initial, self._daemon = view, view.copy(), daemon
        self._stop = threading.Event()
        self.fired = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not np.array_equal(self._view, self._initial):
                    self._daemon.kill()
                    self.fired = True
                    self._daemon.start()
                    return
                os.sched_yield()
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self.error = exc

    def wait(self) -> None:
        """Stop watching; once it fired, the new daemon is serving when this returns."""
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive() and self.error is None, self.error


def transfers(
    client_kind: str, daemon: Daemon, method: str, ns_name: str, path: Path, keys, offsets, killer: Killer
) -> tuple[object, object]:
    """With one fresh client: the transfer under test (its result or error), then, once the
    killer is done, a one-chunk transfer of the same kind (its result or error)."""
    if client_kind == "sync":
        with daemon.client(deadline_s=30.0) as c:
            ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
            region = c.register_region(path)
            transfer = getattr(c, method)
            try:
                outcome = transfer(ns, region, keys, offsets)
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                outcome = exc
            killer.wait()
            return outcome, transfer(ns, region, keys[:1], offsets[:1])

    async def run():
        async with daemon.async_client(deadline_s=30.0) as c:
            ns = await c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
            region = await c.register_region(path)
            transfer = getattr(c, method)
            try:
                outcome = await transfer(ns, region, keys, offsets)
            except Exception as exc:  # noqa: BLE001
                outcome = exc
            await asyncio.to_thread(killer.wait)
            return outcome, await transfer(ns, region, keys[:1], offsets[:1])

    return asyncio.run(run())


def one_attempt(daemon_factory, client_kind: str, method: str, ns_name: str, tmp: Path, i: int) -> Attempt:
    d = daemon_factory(cpu_bytes="160MiB")
    keys = make_keys(f"{ns_name}/{i}", N)
    data = payloads(keys, CHUNK)
    offsets = [k * CHUNK for k in range(N)]
    path = tmp / f"region-{i}"
    loading = method == "load_to_region"
    with open(path, "wb") as fh:
        fh.write(np.full(N * CHUNK, UNTOUCHED, np.uint8).tobytes() if loading else data.tobytes())
    region = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        if loading:
            with d.client() as c:
                ns = c.register_namespace(model=ns_name, dtype="uint8", chunk_bytes=CHUNK)
                assert c.store(ns, keys, data).stored == N
        with raw(d.socket) as conn:  # a store's first bytes land at the start of a fresh pool
            assert conn.session is not None and conn.session.pool is not None
            killer = Killer(region[:8] if loading else conn.session.pool[:8], d)
            try:
                outcome, followup = transfers(client_kind, d, method, ns_name, path, keys, offsets, killer)
            finally:
                killer.wait()
        changed = 0
        if loading:
            untouched = np.full(CHUNK, UNTOUCHED, np.uint8)
            changed = sum(not np.array_equal(region[k * CHUNK : (k + 1) * CHUNK], untouched) for k in range(N))
            if isinstance(outcome, int):  # an answer: exactly the leading `outcome` chunks were copied
                np.testing.assert_array_equal(region[: outcome * CHUNK].reshape(outcome, CHUNK), data[:outcome])
                assert changed == outcome, f"reported {outcome} chunk(s) loaded, but {changed} changed"
            mid_copy = 0 < changed < N
        else:  # killed once the copy had begun, and no complete answer came first
            mid_copy = killer.fired and not (isinstance(outcome, StoreResult) and outcome.stored == N)
        return Attempt(outcome, followup, changed, mid_copy)
    finally:
        del region
        path.unlink()


@pytest.mark.parametrize("method", ["load_to_region", "store_from_region"])
@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_daemon_killed_mid_copy_is_an_unknown_outcome(daemon_factory, ns_name, client_kind, method):
    shm = Path("/dev/shm") / f"kvkill-{os.getpid()}-{client_kind}-{method}"
    shm.mkdir()
    attempts: list[Attempt] = []
    try:
        for i in range(ATTEMPTS):
            attempts.append(one_attempt(daemon_factory, client_kind, method, ns_name, shm, i))
            if attempts[-1].mid_copy:
                break
    finally:
        shm.rmdir()
    landed = [a for a in attempts if a.mid_copy]
    print(
        f"{client_kind} {method}: {len(attempts)} attempt(s), {len(landed)} kill(s) mid-copy, "
        f"changed chunks {[a.changed for a in attempts]}, outcomes {[str(a.outcome)[:120] for a in attempts]}"
    )
    assert landed, f"no kill landed mid-copy in {ATTEMPTS} attempts: {attempts}"
    for attempt in landed:
        assert isinstance(attempt.outcome, TransferOutcomeUnknown), (
            f"the daemon died mid-copy ({attempt.changed} of {N} chunks changed) and the client said "
            f"{str(attempt.outcome)[:300]}"
        )
        # The same client goes on with the new daemon (empty: the load misses, the store stores).
        expected = 0 if method == "load_to_region" else StoreResult(stored=1)
        assert attempt.followup == expected, attempt.followup
