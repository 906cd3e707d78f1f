# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Lookups asked once per engine step: the probe table of the secondary tier (tier.py) and the
direct spec (direct.py), after vLLM's AsyncLookupManager.

vLLM asks about one key at a time and must not wait, so a key's first lookup queues it and answers
RETRY (None here); the owner sends the queued keys as one RPC per batch at the end of the step
(`flush`) and hands the answers back (`resolve`). A verdict is shared by every request that asked
for the key while it stood; a miss is not handed to a request that did not ask for it (the chunk
may have been stored since), and neither is a hit when the owner holds what a hit found (the
direct spec's leases) and asks again once that is gone (`reask_hits`).

Batches are per namespace, or per request and namespace (`per_request`, for an RPC that answers
a prefix, such as Acquire: such a batch is sent, or expires, as a whole). Keys whose requests
all finished before their batch went out are not asked for. vLLM-free: keys are bytes (vLLM's
OffloadKey), a request is anything with a `req_id` (vLLM's ReqContext).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Request(Protocol):
    @property
    def req_id(self) -> str: ...


KeyT = TypeVar("KeyT", bound=bytes)
RequestT = TypeVar("RequestT", bound=Request)
ProbeKey = tuple[str, KeyT]  # (namespace id, key)


@dataclass(slots=True)
class Probe:
    """One key's lookup verdict, shared by the requests that asked."""

    since: float  # when it was queued (the lookup deadline counts from here)
    result: bool | None = None  # None: not answered yet
    in_flight: bool = False  # sent, not answered yet
    requests: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Batch(Generic[KeyT, RequestT]):
    namespace_id: str
    req_id: str  # "" in per-namespace batches
    request: RequestT | None  # the request of a per-request batch (it knows its keys' positions)
    keys: list[KeyT] = field(default_factory=list)


# flush's `send(namespace_id, keys, request)`: True when the keys were sent (all of them).
Send = Callable[[str, list[KeyT], RequestT | None], bool]


class LookupBatcher(Generic[KeyT, RequestT]):
    def __init__(self, *, per_request: bool = False, reask_hits: bool = False) -> None:
        self._per_request = per_request
        self._reask_hits = reask_hits
        self._probes: dict[ProbeKey[KeyT], Probe] = {}
        self._by_request: dict[str, set[ProbeKey[KeyT]]] = {}
        self._batches: dict[tuple[str, str], Batch[KeyT, RequestT]] = {}

    @property
    def queued(self) -> bool:
        """Whether keys wait for the next flush."""
        return bool(self._batches)

    def probe(self, probe_key: ProbeKey[KeyT]) -> Probe | None:
        return self._probes.get(probe_key)

    def ask(self, namespace_id: str, key: KeyT, request: RequestT) -> bool | None:
        """The verdict on `key` for `request` so far: True (hit), False (miss) or None (asked,
        not answered yet: vLLM's RETRY). Queues the key when it needs asking."""
        probe_key = (namespace_id, key)
        req_id = request.req_id
        probe = self._probes.get(probe_key)
        if (
            probe is None
            or (probe.result is False and req_id not in probe.requests)
            or (probe.result is True and self._reask_hits)
        ):
            probe = self._probes[probe_key] = Probe(time.monotonic(), requests=probe.requests if probe else set())
            self._queue(namespace_id, key, request)
        probe.requests.add(req_id)
        self._by_request.setdefault(req_id, set()).add(probe_key)
        return probe.result

    def request_finished(self, req_id: str) -> set[ProbeKey[KeyT]]:
        """Forget the request; returns the keys it asked about. A verdict nobody waits for any
        more is dropped (one in flight once its answer is in)."""
        asked = self._by_request.pop(req_id, set())
        for probe_key in asked:
            probe = self._probes.get(probe_key)
            if probe is None:
                continue
            probe.requests.discard(req_id)
            if not probe.requests and not probe.in_flight:
                del self._probes[probe_key]
        return asked

    def forget(self, probe_key: ProbeKey[KeyT]) -> None:
        """Drop a verdict: the next lookup of the key asks again."""
        self._probes.pop(probe_key, None)

    def flush(self, send: Send[KeyT, RequestT], give_up: bool, timeout_s: float) -> None:
        """Offer every batch to `send`. One it does not send stays queued, except keys waiting
        `timeout_s` or more, or every key when `give_up` (the daemon is down): those are misses."""
        now = time.monotonic()
        for batch_key, batch in list(self._batches.items()):
            namespace_id = batch.namespace_id
            keys = [k for k in dict.fromkeys(batch.keys) if self._wanted(batch, k)]
            if keys and send(namespace_id, keys, batch.request):
                del self._batches[batch_key]
                for key in keys:
                    sent = self._probes.get((namespace_id, key))
                    if sent is not None:
                        sent.in_flight = True
                continue
            overdue = [give_up or now - self._probes[(namespace_id, k)].since >= timeout_s for k in keys]
            if self._per_request and any(overdue):
                overdue = [True] * len(keys)  # a prefix is asked for, or given up, as a whole
            expired = [k for k, late in zip(keys, overdue) if late]
            if expired:
                self.resolve(namespace_id, expired, [False] * len(expired))
            batch.keys = [k for k, late in zip(keys, overdue) if not late]
            if not batch.keys:
                del self._batches[batch_key]

    def resolve(self, namespace_id: str, keys: Iterable[KeyT], found: Iterable[bool]) -> None:
        """The answers for sent (or expired) keys, in order."""
        for key, hit in zip(keys, found):
            probe_key = (namespace_id, key)
            probe = self._probes.get(probe_key)
            if probe is None:
                continue
            probe.in_flight = False
            if not probe.requests:
                del self._probes[probe_key]
                continue
            probe.result = hit

    def mark_miss(self, namespace_id: str, keys: Iterable[KeyT]) -> None:
        """Turn answered verdicts into misses (e.g. after the daemon failed to deliver them)."""
        for key in keys:
            probe = self._probes.get((namespace_id, key))
            if probe is not None and probe.result is not None:
                probe.result = False

    def _queue(self, namespace_id: str, key: KeyT, request: RequestT) -> None:
        req_id = request.req_id if self._per_request else ""
        batch = self._batches.get((namespace_id, req_id))
        if batch is None:
            batch = self._batches[(namespace_id, req_id)] = Batch(
                namespace_id, req_id, request if self._per_request else None
            )
        batch.keys.append(key)

    def _wanted(self, batch: Batch[KeyT, RequestT], key: KeyT) -> bool:
        """Whether a queued key is still to be asked for: a request that queued it still waits."""
        probe = self._probes.get((batch.namespace_id, key))
        return probe is not None and (not batch.req_id or batch.req_id in probe.requests)
