# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The local kvstored daemon as a secondary tier of vLLM's TieringOffloadingSpec.

    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "kvstored", "kvstored_socket": "/run/kvstored/kvstored.sock"}]
    }

(`"type": "kvstored"` comes from the `vllm.general_plugins` entry point; without the plugin use
`{"type": "KvstoredTierManager", "module_path": "kvstored_client.vllm.tier", ...}`.)

Data path: vLLM's primary CPU region (/dev/shm/vllm_offload_<engine_id>.mmap, chunk c at view[c])
is handed to the daemon as an open fd over the session socket; stores and loads name chunks by
byte offset in it and the daemon copies between that region and its own tiers. No KV bytes cross
gRPC.

vLLM's contract: every method runs in the scheduler, under the manager lock, and must not block.
So nothing here waits: lookups are batched once per engine step (RETRY until the batch answers),
transfers are gRPC futures collected by get_finished_jobs(), and the session is set up by a
polled, non-blocking handshake (driver.DaemonLink). Failure is part of the protocol: when the
daemon is absent, slow or restarting, lookups answer MISS, stores are dropped (reported as failed
cascades) and loads fail so vLLM recomputes; the link reconnects by itself.

One rule is never relaxed: a transfer the daemon may still be executing is never reported as
finished, since the daemon would still be reading or writing the primary slots vLLM then reuses.
A started transfer therefore has no client deadline; it ends when the daemon answers, or when the
daemon dies (its connection breaks). A session the link ends while the daemon lives (driver.py:
_Closing) ends its transfers only once the daemon has closed its side, after its copies.
drain_jobs() waits for exactly that.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import grpc
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.blocks import to_pb as blocks_pb
from kvstored_client.droplog import DropLog
from kvstored_client.keyindex import Touches
from kvstored_client.kinds import DropReason
from kvstored_client.paths import default_socket_path
from kvstored_client.vllm.driver import Call, DaemonLink, LinkOptions, LinkState, Outcome, outcome
from kvstored_client.vllm.identity import IdentitySource
from kvstored_client.vllm.lookups import LookupBatcher
from kvstored_client.vllm.namespace import (
    SHA256_OFFLOAD_KEY_BYTES,
    TIER_ROW_FORMAT,
    RequestNamespaces,
    layout_info,
    namespace_spec,
    prefill_rate,
)
from kvstored_client.vllm.plugin import SOCKET_OPTION, socket_option
from kvstored_client.vllm.region import RegionNotShareable, region_file
from kvstored_client.vllm.removals import RemovalWatch

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

TIER_TYPE = "kvstored"
_DRAIN_WARN_S = 5.0
_SHUTDOWN_DRAIN_S = 10.0
_HELD = frozenset((pb.STORE_OUTCOME_STORED, pb.STORE_OUTCOME_ALREADY_PRESENT))  # in the daemon after a store
_DROP_LABELS = {int(r): r.label for r in DropReason if r is not DropReason.NONE}
# What each dropped_chunks reason means, for the tier's rate-limited log line.
_DROP_WHY = {
    "backpressure": "more than max_inflight_store_chunks chunks were in flight to the daemon",
    "slow": "a lookup missed its deadline just before: stores are dropped at once until the daemon answers in time",
    "unavailable": "the daemon is unreachable, or the session or namespace was not ready within the queue timeout",
    "error": "the daemon's StoreFromRegion call failed (rpc_errors counts its code)",
    "daemon_full": "the daemon dropped them without saying why (a daemon older than its drop reasons)",
    "drained": "vLLM drained the tier's jobs (a cache reset, a shutdown) before the store was sent",
}
_DAEMONS_REASON = "the daemon's reason (its log says more: stores dropped ...)"


class KvstoredMetrics:
    """Metric names this tier emits (all declared by build_metric_definitions)."""

    LOOKUP_RPCS = "vllm:kv_offload_kvstored_lookup_rpcs"
    LOCAL_HITS = "vllm:kv_offload_kvstored_local_hits"
    LOOKUP_RPC_SECONDS = "vllm:kv_offload_kvstored_lookup_rpc_seconds"
    DROPPED_CHUNKS = "vllm:kv_offload_kvstored_dropped_chunks"
    FAILED_LOAD_CHUNKS = "vllm:kv_offload_kvstored_failed_load_chunks"
    RPC_ERRORS = "vllm:kv_offload_kvstored_rpc_errors"
    SESSIONS_OPENED = "vllm:kv_offload_kvstored_sessions_opened"
    CONNECTED = "vllm:kv_offload_kvstored_connected"
    INFLIGHT_CHUNKS = "vllm:kv_offload_kvstored_inflight_chunks"


@dataclass(slots=True)
class _LookupCall:
    future: Call
    namespace_id: str
    keys: list[OffloadKey]
    sent_at: float


@dataclass(slots=True)
class _Transfer:
    job_id: int
    is_load: bool
    namespace_id: str
    keys: list[OffloadKey]
    offsets: list[int]
    queued_at: float
    started_at: float = 0.0
    futures: list[tuple[Call, int]] = field(default_factory=list)  # (future, first key index)


class KvstoredTierManager(SecondaryTierManager):
    """vLLM secondary tier backed by the node's kvstored daemon (see module docstring)."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        kvstored_socket: str | None = None,
        socket: str | None = None,
        lookup_timeout_s: float = 0.25,
        connect_timeout_s: float = 1.0,
        queue_timeout_s: float = 1.0,
        max_inflight_store_chunks: int | None = None,
        max_batch_keys: int = 1024,
        transfer_chunks_per_rpc: int = 16,
        key_bytes: int = SHA256_OFFLOAD_KEY_BYTES,
        enable_kv_events: bool = True,
        locality: str | None = "LOCAL",
        client_name: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        prefill_tokens_per_s: float | None = None,
    ) -> None:
        """Args (all but the first three come from the tier's config dict):
        kvstored_socket: the daemon's gRPC unix socket (default: $KVSTORED_SOCKET, else the
            standard path); the same name as in the direct spec. `socket` is an alias.
        lookup_timeout_s: a lookup batch unanswered this long counts as all misses.
        connect_timeout_s: one step of the session handshake may take this long.
        queue_timeout_s: a transfer waits at most this long for the session to come up.
        max_inflight_store_chunks: stores beyond this many chunks in flight are dropped
            (default: no limit beyond the primary tier's own, which cannot pin more chunks than
            it has; set it to keep part of the primary free while the daemon is slow).
        max_batch_keys: keys per lookup RPC (the daemon's max_batch_keys must not be lower).
        transfer_chunks_per_rpc: a store or load job is sent as RPCs of this many chunks, which
            the daemon copies in parallel.
        key_bytes: the OffloadKey length registered up front (36 for sha256 block hashes);
            other lengths are registered when first seen.
        enable_kv_events: report BlockStored events for chunks this tier stored (effective only
            when vLLM's KV cache events are enabled).
        locality: LOCAL or REMOTE, reported with events and used by request tier filters.
        prefill_tokens_per_s: how fast this engine prefills (vLLM does not measure it; default
            $KVSTORED_PREFILL_TOKENS_PER_S, else unknown): with it the daemon reports a hit
            below RAM only where loading it beats recomputing (docs/vllm.md).
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self._lookup_timeout_s = float(lookup_timeout_s)
        self._queue_timeout_s = float(queue_timeout_s)
        num_chunks = primary_kv_view.shape[0] if primary_kv_view.shape else 0
        self._max_inflight_store = int(max_inflight_store_chunks or max(1, num_chunks))
        self._max_batch_keys = max(1, int(max_batch_keys))
        self._rpc_chunks = max(1, min(int(transfer_chunks_per_rpc), self._max_batch_keys))
        self._layout = layout_info(offloading_spec, TIER_ROW_FORMAT, parallel_agnostic=True)
        self._prefill_tokens_per_s = prefill_rate(prefill_tokens_per_s)

        self._identities: IdentitySource | None = None  # see use_identities
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []

        scheduler_region = getattr(offloading_spec, "_scheduler_mmap", None)
        scheduler_fd = getattr(scheduler_region, "fd", None)
        candidates = [scheduler_fd] if scheduler_fd is not None else []
        self._region_fd: int | None = None
        self._region_base = 0
        try:
            region = region_file(primary_kv_view, candidates)
            self._region_fd, self._region_base = region.fd, region.base_offset
            region_name = os.path.basename(region.path)
        except (RegionNotShareable, OSError) as exc:
            # Without the region the daemon can move no bytes: the tier stays empty (all misses).
            log.error("kvstored tier disabled: the primary region cannot be shared with the daemon: %s", exc)
            region_name = ""

        self._link = DaemonLink(
            socket_option({SOCKET_OPTION: kvstored_socket, "socket": socket}) or default_socket_path(),
            client_name or f"vllm-tier-{offloading_spec.config.engine_id}-pid{os.getpid()}",
            region_fd=self._region_fd,
            region_name=region_name,
            options=LinkOptions(connect_timeout_s=float(connect_timeout_s), rpc_timeout_s=float(connect_timeout_s)),
        )
        self._namespaces = RequestNamespaces(
            lambda key_bytes, salt: namespace_spec(
                self._layout, self.block_size_bytes, key_bytes, salt, self._prefill_tokens_per_s
            ),
            self._link.namespace,
        )
        self._batcher: LookupBatcher[OffloadKey, ReqContext] = LookupBatcher()  # one lookup batch per namespace
        self._lookups: list[_LookupCall] = []
        self._touches = Touches()  # keys found in the namespaces' key indexes this step
        self.local_hits = 0  # lookups answered HIT from a key index (benches read it)
        self._waiting: deque[_Transfer] = deque()  # waiting for the session / namespace
        self._running: dict[int, _Transfer] = {}
        self._finished: list[JobResult] = []
        self._inflight_store_chunks = 0
        self._slow_until = 0.0  # lookups timed out: answer MISS without asking until then
        self._stats = OffloadingConnectorStats()
        # dropped_chunks, also as one log line per reason per 10 s
        self._drop_log = DropLog(f"kvstored tier at {self._link.socket_path}")
        self._label = (tier_type,)
        self._sessions_reported = 0
        self._stored_namespaces: set[str] = set()
        # The daemon's evictions, reported to vLLM (only where the tier reports stores).
        self._removals: RemovalWatch | None = None
        if self.events is not None and self._region_fd is not None:
            self._removals = RemovalWatch(
                self._link.socket_path, lambda: self._link.session_id, lambda: self._stored_namespaces
            )
        if self._region_fd is not None:
            # Start-up (not a scheduler step): wait briefly so the first requests find the session up.
            self._link.settle(float(connect_timeout_s), (self._namespaces.id_for(key_bytes),))
            self._start_removals()

    def _start_removals(self) -> None:
        if self._removals is not None and self._link.ready:
            self._removals.start()

    @property
    def connected(self) -> bool:
        """Whether the session with the daemon is up (as of the last poll)."""
        return self._link.ready

    @property
    def link(self) -> DaemonLink:
        """The tier's link to the daemon (its counters say which transport the calls took)."""
        return self._link

    def use_identities(self, source: IdentitySource) -> None:
        """Send each stored chunk's block identity (from vLLM's events tracker, see
        identity.py) with the store, so the daemon's KV events name its engine blocks."""
        self._identities = source

    # -- vLLM API: lookups --------------------------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._namespaces.on_new_request(req_context)
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._lookups:
            self._collect_lookups()
        if self._unusable():
            return LookupResult.MISS
        namespace_id = self._namespace_of(key, req_context)
        if namespace_id is None:
            return LookupResult.MISS
        if self._in_ram(namespace_id, key):
            return LookupResult.HIT
        found = self._batcher.ask(namespace_id, key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._batcher.request_finished(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Once per step: advance the link, collect answers, send this step's lookup batch."""
        self._link.poll()
        self._start_removals()
        self._collect_lookups()
        self._flush_lookups()
        self._send_touches()
        self._pump()

    # -- vLLM API: transfers ------------------------------------------------------------------

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        transfer = self._transfer(job_metadata, is_load=False)
        if transfer is None:
            return
        if self._inflight_store_chunks + len(transfer.keys) > self._max_inflight_store:
            self._drop_store(transfer, "backpressure")
            return
        if time.monotonic() < self._slow_until:
            self._drop_store(transfer, "slow")
            return
        self._inflight_store_chunks += len(transfer.keys)
        self._waiting.append(transfer)
        self._pump()

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        transfer = self._transfer(job_metadata, is_load=True)
        if transfer is None:
            return
        self._waiting.append(transfer)
        self._pump()

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._link.poll()
        self._collect_transfers()
        self._pump()
        finished, self._finished = self._finished, []
        return finished

    @override
    def has_pending_work(self) -> bool:
        return bool(self._running or self._waiting or self._lookups or self._batcher.queued)

    @override
    def drain_jobs(self) -> None:
        """Block until no transfer can touch the primary region any more.

        Queued transfers (not sent) fail at once. Sent ones are waited for: the daemon may be
        copying them right now, and a client-side timeout would not stop it."""
        self._drain(limit_s=None)

    def _drain(self, limit_s: float | None) -> None:
        while self._waiting:
            self._fail_transfer(self._waiting.popleft(), "drained")
        start = time.monotonic()
        for transfer in list(self._running.values()):
            for future, _ in transfer.futures:
                while True:
                    try:
                        future.exception(timeout=_DRAIN_WARN_S)
                        break
                    except grpc.FutureTimeoutError:
                        waited = time.monotonic() - start
                        if limit_s is not None and waited > limit_s:
                            return
                        log.warning(
                            "kvstored tier: waiting %.0fs for job %d (the daemon is still working on "
                            "the primary region)",
                            waited,
                            transfer.job_id,
                        )
        self._collect_transfers()

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._removals is not None and self.events is not None:
            gone = [OffloadKey(key) for _, key in self._removals.take_gone()]
            if gone:
                self.events.append(OffloadingEvent(keys=gone, medium=self.medium, removed=True, locality=self.locality))
        if self.events:
            events, self.events = self.events, []
            yield from events

    @override
    def shutdown(self) -> None:
        # Bounded: after shutdown vLLM no longer reuses the region, and a daemon still copying
        # uses its own mapping of it.
        self._drain(limit_s=_SHUTDOWN_DRAIN_S)
        for call in self._lookups:
            call.future.cancel()
        self._lookups.clear()
        if self._removals is not None:
            self._removals.close()
        self._link.close()
        if self._region_fd is not None:
            os.close(self._region_fd)
            self._region_fd = None

    # -- metrics ------------------------------------------------------------------------------

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        tier = ("tier",)
        return {
            KvstoredMetrics.LOOKUP_RPCS: OffloadingCounterMetadata(
                documentation="Lookup RPCs sent to kvstored (one per namespace per engine step).", labelnames=tier
            ),
            KvstoredMetrics.LOCAL_HITS: OffloadingCounterMetadata(
                documentation="Lookups answered HIT at once from the daemon's key index (chunks in its RAM), "
                "with no Lookup RPC.",
                labelnames=tier,
            ),
            KvstoredMetrics.LOOKUP_RPC_SECONDS: OffloadingHistogramMetadata(
                documentation="Time from sending a lookup batch to kvstored to collecting its answer, in seconds.",
                labelnames=tier,
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            ),
            KvstoredMetrics.DROPPED_CHUNKS: OffloadingCounterMetadata(
                documentation="Chunks not stored in kvstored, by reason (unavailable, slow, backpressure, "
                "error; the daemon's own: ram_full, quota_full, in_progress, not_visible).",
                labelnames=("tier", "reason"),
            ),
            KvstoredMetrics.FAILED_LOAD_CHUNKS: OffloadingCounterMetadata(
                documentation="Chunks a promotion from kvstored could not load (vLLM recomputes them).", labelnames=tier
            ),
            KvstoredMetrics.RPC_ERRORS: OffloadingCounterMetadata(
                documentation="Failed kvstored RPCs, by gRPC status code.", labelnames=("tier", "code")
            ),
            KvstoredMetrics.SESSIONS_OPENED: OffloadingCounterMetadata(
                documentation="Sessions opened with kvstored (more than one: the daemon restarted or was "
                "unreachable for a while).",
                labelnames=tier,
            ),
            KvstoredMetrics.CONNECTED: OffloadingGaugeMetadata(
                documentation="1 while the session with kvstored is up, else 0.", labelnames=tier
            ),
            KvstoredMetrics.INFLIGHT_CHUNKS: OffloadingGaugeMetadata(
                documentation="Chunks of transfers kvstored is working on, by direction (store, load).",
                labelnames=("tier", "op"),
            ),
        }

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        stats, self._stats = self._stats, OffloadingConnectorStats()
        opened = self._link.counters.sessions_opened
        if opened > self._sessions_reported:
            stats.increase_counter(KvstoredMetrics.SESSIONS_OPENED, opened - self._sessions_reported, self._label)
            self._sessions_reported = opened
        stats.set_gauge(KvstoredMetrics.CONNECTED, int(self._link.ready), self._label)
        loads = sum(len(t.keys) for t in self._running.values() if t.is_load)
        stats.set_gauge(KvstoredMetrics.INFLIGHT_CHUNKS, self._inflight_store_chunks, (self.tier_type, "store"))
        stats.set_gauge(KvstoredMetrics.INFLIGHT_CHUNKS, loads, (self.tier_type, "load"))
        return stats

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return (SOCKET_OPTION,)

    @override
    def config_info(self) -> ConfigInfoMapping:
        return {SOCKET_OPTION: str(self._link.socket_path)}

    # -- internals: namespaces ------------------------------------------------------------------

    def _unusable(self) -> bool:
        """Answer MISS without asking: no region, daemon down, or recently too slow."""
        if self._region_fd is None:
            return True
        if self._link.state is LinkState.DOWN and not self._link.poll():
            return self._link.state is LinkState.DOWN
        return time.monotonic() < self._slow_until

    def _namespace_of(self, key: OffloadKey, req_context: ReqContext) -> str | None:
        namespace_id = self._namespaces.id_of(key, req_context)
        return None if self._link.namespace_broken(namespace_id) else namespace_id

    # -- internals: lookups ---------------------------------------------------------------------

    def _in_ram(self, namespace_id: str, key: OffloadKey) -> bool:
        """Whether the namespace's key index (mapped once the namespace is registered in the
        session) says the daemon's RAM holds the key: a HIT with no round trip. Its hits are
        told to the daemon once per step (_send_touches: recency, metrics)."""
        if not (self._link.ready and self._link.namespace_ready(namespace_id)):
            return False
        index = self._link.key_index(namespace_id)
        if index is None or not index.leading([key]):
            return False
        self._touches.add(namespace_id, [key], 0.0)  # (sent once per step: no clock needed)
        self._stats.increase_counter(KvstoredMetrics.LOCAL_HITS, 1, self._label)
        self.local_hits += 1
        return True

    def _send_touches(self) -> None:
        touches, self._touches = self._touches, Touches()
        if not self._link.ready:
            return  # (a hint only: a session coming up has none to give)
        # (each key once, with the lookups it answered; no more keys per request than the tier's batches)
        for namespace_id, keys, lookups in touches.take(self._max_batch_keys):
            request = pb.TouchRequest(
                session_id=self._link.session_id, namespace_id=namespace_id, keys=keys, lookups=lookups
            )
            self._link.call("Touch", request, timeout=self._lookup_timeout_s)  # (its answer: nothing to act on)

    def _flush_lookups(self) -> None:
        # Not sendable (session coming up, namespace registering, daemon slow or down): keys
        # waiting longer than the lookup deadline are misses, all of them if the daemon is down.
        now = time.monotonic()
        give_up = self._link.state is LinkState.DOWN or now < self._slow_until
        self._batcher.flush(self._send_lookups, give_up, self._lookup_timeout_s)

    def _send_lookups(self, namespace_id: str, keys: list[OffloadKey], _request: ReqContext | None) -> bool:
        now = time.monotonic()
        if not (self._link.namespace_ready(namespace_id) and now >= self._slow_until):
            return False
        for start in range(0, len(keys), self._max_batch_keys):
            chunk = keys[start : start + self._max_batch_keys]
            # The loads that follow copy into vLLM's primary region: hits below the daemon's
            # RAM reach it through staging memory when RAM is full, evicting nothing.
            request = pb.LookupRequest(
                namespace_id=namespace_id, keys=chunk, session_id=self._link.session_id, load_into=pb.LOAD_INTO_REGION
            )
            future = self._link.call("Lookup", request, timeout=self._lookup_timeout_s)
            self._lookups.append(_LookupCall(future, namespace_id, chunk, now))
            self._stats.increase_counter(KvstoredMetrics.LOOKUP_RPCS, 1, self._label)
        return True

    def _collect_lookups(self) -> None:
        pending = []
        now = time.monotonic()
        for call in self._lookups:
            if not call.future.done():
                pending.append(call)
                continue
            result = outcome(call.future)
            self._stats.observe_histogram(KvstoredMetrics.LOOKUP_RPC_SECONDS, now - call.sent_at, self._label)
            if result.ok:
                found = [tier != pb.TIER_KIND_UNSPECIFIED for tier in result.response.tiers]
            else:
                found = [False] * len(call.keys)
                self._rpc_error(result)
                if result.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._slow_until = now + self._lookup_timeout_s * 4
            self._batcher.resolve(call.namespace_id, call.keys, found)
        self._lookups = pending

    # -- internals: transfers -------------------------------------------------------------------

    def _transfer(self, job: TransferJob, is_load: bool) -> _Transfer | None:
        keys = list(job.keys)
        if not keys:
            # vLLM's secondary-tier contract: a batch of any size succeeds, the empty one included
            # (a failure would count as a failed cascade or promotion).
            self._finished.append(JobResult(job_id=job.job_id, success=True, transfer_time=0.0, transfer_bytes=0))
            return None
        stride = self.block_size_bytes
        offsets = [self._region_base + int(c) * stride for c in job.chunk_ids]
        namespace_id = None
        if keys and self._region_fd is not None:
            namespace_id = self._namespace_of(keys[0], job.req_context)
        transfer = _Transfer(job.job_id, is_load, namespace_id or "", keys, offsets, time.monotonic())
        if namespace_id is not None and not is_load:
            self._stored_namespaces.add(namespace_id)
        if namespace_id is None:
            if is_load:
                self._fail_transfer(transfer, "disabled")
            else:
                self._drop_store(transfer, "unavailable")
            return None
        return transfer

    def _pump(self) -> None:
        """Start waiting transfers once the session and their namespace are ready; fail the ones
        that waited too long or whose daemon is down."""
        if not self._waiting:
            return
        now = time.monotonic()
        still: deque[_Transfer] = deque()
        while self._waiting:
            transfer = self._waiting.popleft()
            if self._link.ready and self._link.namespace_ready(transfer.namespace_id):
                self._start(transfer, now)
            elif self._link.state is LinkState.DOWN or now - transfer.queued_at > self._queue_timeout_s:
                self._fail_transfer(transfer, "unavailable")
            else:
                still.append(transfer)
        self._waiting = still

    def _start(self, transfer: _Transfer, now: float) -> None:
        method = "LoadToRegion" if transfer.is_load else "StoreFromRegion"
        transfer.started_at = now
        for start in range(0, len(transfer.keys), self._rpc_chunks):
            end = start + self._rpc_chunks
            keys = transfer.keys[start:end]
            blocks = []
            if self._identities is not None and not transfer.is_load:
                blocks = blocks_pb([self._identities(k) for k in keys], len(keys))
            request = pb.RegionTransferRequest(
                session_id=self._link.session_id,
                namespace_id=transfer.namespace_id,
                region_id=self._link.region_id,
                keys=keys,
                offsets=transfer.offsets[start:end],
                blocks=blocks,
            )
            # No deadline: see the module docstring (a started transfer ends when the daemon answers or dies).
            transfer.futures.append((self._link.call(method, request), start))
        self._running[transfer.job_id] = transfer

    def _collect_transfers(self) -> None:
        for job_id in [j for j, t in self._running.items() if all(f.done() for f, _ in t.futures)]:
            transfer = self._running.pop(job_id)
            if transfer.is_load:
                self._finish_load(transfer)
            else:
                self._finish_store(transfer)

    def _finish_store(self, transfer: _Transfer) -> None:
        self._inflight_store_chunks -= len(transfer.keys)
        stored, held, dropped, error = 0, [], 0, False
        for future, start in transfer.futures:
            batch = transfer.keys[start : start + self._rpc_chunks]
            result = outcome(future)
            if not result.ok:
                error = True
                dropped += len(batch)
                self._count_dropped("error", len(batch))
                self._rpc_error(result)
                continue
            response = result.response
            stored += response.stored
            dropped += response.dropped
            if len(response.outcomes) == len(batch):
                held += [k for k, o in zip(batch, response.outcomes) if o in _HELD]
            elif not response.dropped:  # a daemon without per-key outcomes: all or nothing
                held += batch
            self._count_daemon_drops(response)
        # Routers hear of every chunk the daemon now holds, even when part of the job was dropped.
        # No ownership: routers (Dynamo) drop events that carry one. removal_expected: the tier
        # reports the daemon's evictions (removals.py), so vLLM's tracker keeps the chunk's
        # identity until then.
        if held and self.events is not None:
            if self._removals is not None:
                self._removals.reported(transfer.namespace_id, held)
            self.events.append(
                OffloadingEvent(
                    keys=held,
                    medium=self.medium,
                    removed=False,
                    locality=self.locality,
                    removal_expected=self._removals is not None,
                )
            )
        self._finished.append(
            JobResult(
                job_id=transfer.job_id,
                success=not error and dropped == 0,
                transfer_time=time.monotonic() - transfer.started_at,
                transfer_bytes=stored * self.block_size_bytes,
            )
        )

    def _finish_load(self, transfer: _Transfer) -> None:
        loaded: list[OffloadKey] = []
        for future, start in transfer.futures:
            batch = transfer.keys[start : start + self._rpc_chunks]
            result = outcome(future)
            if result.ok:
                loaded.extend(batch[: result.response.loaded])
            else:
                self._rpc_error(result)
        success = len(loaded) == len(transfer.keys)
        if not success:
            loaded_set = set(loaded)
            failed = [k for k in transfer.keys if k not in loaded_set]
            self._batcher.mark_miss(transfer.namespace_id, failed)  # no livelock on chunks it cannot deliver
            self._stats.increase_counter(KvstoredMetrics.FAILED_LOAD_CHUNKS, len(failed), self._label)
        self._finished.append(
            JobResult(
                job_id=transfer.job_id,
                success=success,
                successful_keys=tuple(loaded) if not success and loaded else None,
                transfer_time=time.monotonic() - transfer.started_at,
                transfer_bytes=len(loaded) * self.block_size_bytes,
            )
        )

    def _fail_transfer(self, transfer: _Transfer, reason: str) -> None:
        """Fail a transfer that never reached the daemon (nothing touches the region)."""
        if transfer.is_load:
            self._batcher.mark_miss(transfer.namespace_id, transfer.keys)
            self._stats.increase_counter(KvstoredMetrics.FAILED_LOAD_CHUNKS, len(transfer.keys), self._label)
            self._finished.append(JobResult(job_id=transfer.job_id, success=False))
        else:
            self._inflight_store_chunks -= len(transfer.keys)
            self._drop_store(transfer, reason)

    def _drop_store(self, transfer: _Transfer, reason: str) -> None:
        self._count_dropped(reason, len(transfer.keys))
        self._finished.append(JobResult(job_id=transfer.job_id, success=False))

    def _count_daemon_drops(self, response: pb.StoreFromRegionResponse) -> None:
        """The daemon's dropped chunks, by the reason it gives for each (ram_full, quota_full,
        in_progress, ...; "daemon_full" from a daemon too old to say)."""
        if not response.dropped:
            return
        reasons = Counter(r for r in response.drop_reasons if r)
        for reason, n in reasons.items():
            self._count_dropped(_DROP_LABELS.get(reason, "daemon_full"), n)
        if response.dropped > sum(reasons.values()):
            self._count_dropped("daemon_full", response.dropped - sum(reasons.values()))

    def _count_dropped(self, reason: str, n: int) -> None:
        self._stats.increase_counter(KvstoredMetrics.DROPPED_CHUNKS, n, (self.tier_type, reason))
        why = _DAEMONS_REASON if reason in _DROP_LABELS.values() else _DROP_WHY.get(reason, reason)
        self._drop_log.record(reason, n, why)

    def _rpc_error(self, result: Outcome) -> None:
        code = result.code.name if result.code is not None else "UNKNOWN"
        self._stats.increase_counter(KvstoredMetrics.RPC_ERRORS, 1, (self.tier_type, code))
        self._link.on_rpc_error(result)
