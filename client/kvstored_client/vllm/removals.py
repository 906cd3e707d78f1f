# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Which chunks the tier reported to vLLM have left the daemon: vLLM's events learn of removals.

The daemon evicts and deletes on its own; vLLM's event stream (and vLLM's tracker, which keeps
a chunk's identity until its removal) must hear of it. One thread follows the daemon's
WatchEvents stream (a blocking gRPC iterator: the scheduler's methods must not block, and gRPC's
sync API has no non-blocking read) and keeps, for the tier's namespaces, the daemon tiers
holding each chunk. A reported chunk that no daemon tier holds any more is queued; the
scheduler takes the queue in take_events(). The thread only reads; it reconnects after a pause
when the stream ends (a daemon restart) and stops at close().
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.protocol import CHANNEL_OPTIONS, channel_target

log = logging.getLogger(__name__)

RETRY_S = 1.0
ChunkRef = tuple[str, bytes]  # (namespace id, key)


class RemovalWatch:
    def __init__(self, socket_path: Path, session_id: Callable[[], str], namespaces: Callable[[], set[str]]) -> None:
        """session_id: the tier's current session (for its tenant namespaces' events);
        namespaces: the namespace ids the tier uses."""
        self._socket_path = socket_path
        self._session_id = session_id
        self._namespaces = namespaces
        self._lock = threading.Lock()
        self._holders: dict[ChunkRef, set[str]] = {}  # daemon tiers holding each chunk (per the stream)
        self._reported: set[ChunkRef] = set()  # reported to vLLM as stored, not yet as removed
        self._gone: list[ChunkRef] = []
        self._stop = threading.Event()
        self._call: grpc.Future | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstored-removals", daemon=True)
            self._thread.start()

    def reported(self, namespace_id: str, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._reported.update((namespace_id, k) for k in keys)

    def take_gone(self) -> list[ChunkRef]:
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def close(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def apply(self, event: pb.KvEvent) -> None:
        """One event of the stream (also what tests feed it)."""
        if event.namespace_id not in self._namespaces():
            return
        with self._lock:
            for key in event.keys:
                ref = (event.namespace_id, key)
                if event.type == pb.EVENT_TYPE_STORED:
                    self._holders.setdefault(ref, set()).add(event.tier)
                elif event.type == pb.EVENT_TYPE_REMOVED:
                    holders = self._holders.get(ref)
                    if holders is not None:
                        holders.discard(event.tier)
                    if not holders:
                        self._holders.pop(ref, None)
                        if ref in self._reported:
                            self._reported.discard(ref)
                            self._gone.append(ref)

    def _run(self) -> None:
        with grpc.insecure_channel(channel_target(self._socket_path), options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            while not self._stop.is_set():
                try:
                    call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=0, session_id=self._session_id()))
                    self._call = call
                    for event in call:
                        self.apply(event)
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        return
                    log.debug("kvstored tier: event stream ended (%s); following it again", exc.code())
                self._stop.wait(RETRY_S)
