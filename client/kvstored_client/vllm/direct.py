# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Direct spec: vLLM offloads GPU blocks straight into kvstored's shared-memory pool.

    "kv_connector_extra_config": {
        "spec_name": "KvstoredOffloadingSpec",
        "spec_module_path": "kvstored_client.vllm.direct",   # not needed with the plugin
        "kvstored_socket": "/run/kvstored/kvstored.sock"
    }

Host RAM belongs to the daemon: there is no vLLM CPU tier. The cache survives vLLM restarts, and
every vLLM instance on the node shares one pool with one copy per chunk.

Scheduler side (KvstoredDirectManager): lookups are batched per engine step as one `Acquire` per
request, which both answers (leases on the leading cached chunks; RETRY until it returns) and pins
what it found, so prepare_load() can hand the worker the chunks' pool extents without a blocking
call. Leases are released when the load completes or the last request that looked them up
finishes. prepare_store() needs no RPC: the worker reserves slots itself.

Worker side (KvstoredOffloadingWorker -> pool_worker.PoolTransferEngine): maps the pool (pinned
with cudaHostRegister where CUDA exists) and copies blocks GPU -> pool (Reserve / copy / Commit)
and pool -> GPU (with the scheduler's leases). With several workers (tensor parallelism), each
rank stores its own part of a chunk under the chunk's key + 2-byte rank, and a chunk counts as
cached only when every rank's part is.

Limits: Acquire stops at the first chunk that is missing, so lookups have prefix semantics (sliding
window groups, which vLLM scans from the end, hit only on their prefix); canonical and replicated
layouts are not supported; vLLM 0.33 asserts that worker jobs succeed, so a load whose pool this
worker cannot map (a daemon restart racing the worker's first session) stops the engine loudly
rather than loading wrong bytes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.blocks import BlockIdentity
from kvstored_client.ops import NamespaceSpec
from kvstored_client.paths import default_socket_path
from kvstored_client.vllm.blockcopy import ChunkExtents, KVLayout, LayerRef
from kvstored_client.vllm.driver import Call, DaemonLink, LinkOptions, LinkState, arena_key, outcome
from kvstored_client.vllm.identity import IdentitySource
from kvstored_client.vllm.lookups import LookupBatcher, ProbeKey
from kvstored_client.vllm.namespace import (
    PREFILL_OPTION,
    SHA256_OFFLOAD_KEY_BYTES,
    WORKER_PART_FORMAT,
    LayoutInfo,
    RequestNamespaces,
    layout_info,
    namespace_spec,
    prefill_rate,
)
from kvstored_client.vllm.plugin import socket_option
from kvstored_client.vllm.pool_worker import PoolTransferEngine

log = logging.getLogger(__name__)

RANK_SUFFIX_BYTES = 2


class DirectMetrics:
    LOOKUP_RPCS = "vllm:kv_offload_kvstored_direct_lookup_rpcs"
    LEASED_CHUNKS = "vllm:kv_offload_kvstored_direct_leased_chunks"
    CONNECTED = "vllm:kv_offload_kvstored_direct_connected"
    RPC_ERRORS = "vllm:kv_offload_kvstored_direct_rpc_errors"


# -- specs that travel from the scheduler to the workers ------------------------------------------


class KvstoredStoreSpec(LoadStoreSpec):
    """Chunks to store: their keys (each worker appends its rank), the request's cache salt, and
    their block identities for the daemon's KV events (empty: none; see identity.py)."""

    def __init__(self, keys: Sequence[bytes], cache_salt: bytes, blocks: Sequence[BlockIdentity | None] = ()) -> None:
        self.keys = keys
        self.cache_salt = cache_salt
        self.blocks = blocks

    def __repr__(self) -> str:
        return f"KvstoredStoreSpec({len(self.keys)} chunks)"


class KvstoredLoadSpec(LoadStoreSpec):
    """Leased chunks to load: chunk i, rank r lives in pool pool_ids[i] (an arena key) at the
    extents ext_offsets/ext_lengths[starts[i * world_size + r]:starts[i * world_size + r + 1]].
    With a cache salt the chunks are a tenant's: each worker registers the namespace (key_bytes,
    cache_salt) in its own session to map the tenant's arena."""

    def __init__(
        self,
        world_size: int,
        pool_ids: list[str],
        per_part: list[list[tuple[int, int]]],
        key_bytes: int = SHA256_OFFLOAD_KEY_BYTES,
        cache_salt: bytes = b"",
    ) -> None:
        self.world_size = world_size
        self.pool_ids = pool_ids
        self.key_bytes = key_bytes
        self.cache_salt = cache_salt
        extents = ChunkExtents.from_lists(per_part)
        self.starts, self.ext_offsets, self.ext_lengths = extents.starts, extents.ext_offsets, extents.ext_lengths

    def for_rank(self, rank: int) -> ChunkExtents:
        n, w = len(self.pool_ids), self.world_size
        per_chunk = []
        for i in range(n):
            a, b = self.starts[i * w + rank], self.starts[i * w + rank + 1]
            per_chunk.append(list(zip(self.ext_offsets[a:b].tolist(), self.ext_lengths[a:b].tolist())))
        return ChunkExtents.from_lists(per_chunk)

    def __repr__(self) -> str:
        return f"KvstoredLoadSpec({len(self.pool_ids)} chunks)"


def part_key(key: bytes, rank: int, world_size: int) -> bytes:
    return key if world_size == 1 else key + rank.to_bytes(RANK_SUFFIX_BYTES, "big")


# -- the spec ----------------------------------------------------------------------------------


class KvstoredOffloadingSpec(OffloadingSpec):
    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            DirectMetrics.LOOKUP_RPCS: OffloadingCounterMetadata(
                documentation="Acquire RPCs sent to kvstored for lookups (one per request per engine step)."
            ),
            DirectMetrics.LEASED_CHUNKS: OffloadingGaugeMetadata(
                documentation="Chunks the scheduler holds leases on in kvstored (looked up or loading)."
            ),
            DirectMetrics.CONNECTED: OffloadingGaugeMetadata(
                documentation="1 while the scheduler's session with kvstored is up, else 0."
            ),
            DirectMetrics.RPC_ERRORS: OffloadingCounterMetadata(
                documentation="Failed kvstored RPCs of the scheduler, by gRPC status code.", labelnames=("code",)
            ),
        }

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if config.canonical_layout or config.replicated_layout:
            raise ValueError(
                "KvstoredOffloadingSpec supports the direct KV layout only "
                "(remove canonical_layout from kv_connector_extra_config)"
            )
        extra = self.extra_config
        self.socket = socket_option(extra) or str(default_socket_path())
        self.lookup_timeout_s = float(extra.get("kvstored_lookup_timeout_s", 0.25))
        self.connect_timeout_s = float(extra.get("kvstored_connect_timeout_s", 2.0))
        self.store_timeout_s = float(extra.get("kvstored_store_timeout_s", 2.0))
        self.world_size = max(1, config.parallel.world_size)
        self.rank = config.parallel.rank
        self.part_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.layout: LayoutInfo = layout_info(
            self, WORKER_PART_FORMAT, parallel_agnostic=False, include_rank=False, extra={"world_size": self.world_size}
        )
        self.prefill_tokens_per_s = prefill_rate(extra.get(PREFILL_OPTION))
        self._manager: KvstoredDirectManager | None = None
        self._worker: KvstoredOffloadingWorker | None = None

    def namespace_spec(self, key_bytes: int, cache_salt: bytes) -> NamespaceSpec:
        suffix = 0 if self.world_size == 1 else RANK_SUFFIX_BYTES
        # Every rank's part of a chunk loads through this daemon: the break-even is the node's
        return namespace_spec(
            self.layout,
            self.part_bytes,
            key_bytes + suffix,
            cache_salt,
            self.prefill_tokens_per_s,
            self.part_bytes * self.world_size,
        )

    @override
    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvstoredDirectManager(self)
        return self._manager

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvstoredOffloadingWorker(self, kv_caches)
        return self._worker


# -- scheduler side ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Lease:
    pool_id: str
    epoch: int  # the link's session that holds the leases: they end with it
    handles: list[int]
    extents: list[list[tuple[int, int]]]  # per rank
    requests: set[str] = field(default_factory=set)
    loads: int = 0


@dataclass(slots=True)
class _Acquire:
    future: Call
    namespace_id: str
    keys: list[OffloadKey]
    pool_id: str
    epoch: int
    sent_at: float
    expired: bool = False  # answered MISS already (deadline): its leases are released on arrival


class KvstoredDirectManager(OffloadingManager):
    def __init__(self, spec: KvstoredOffloadingSpec) -> None:
        self._spec = spec
        self._world = spec.world_size
        self._link = DaemonLink(
            spec.socket,
            f"vllm-direct-{spec.config.engine_id}-pid{os.getpid()}",
            options=LinkOptions(connect_timeout_s=spec.connect_timeout_s),
        )
        self._namespaces = RequestNamespaces(spec.namespace_spec, self._link.namespace)
        # One Acquire per request and namespace (it answers a prefix); a hit is held as a lease,
        # so the batcher keeps no hit verdicts: a key whose lease went back is asked again.
        self._batcher: LookupBatcher[OffloadKey, ReqContext] = LookupBatcher(per_request=True, reask_hits=True)
        self._leases: dict[ProbeKey[OffloadKey], _Lease] = {}
        self._req_leases: dict[str, set[ProbeKey[OffloadKey]]] = {}  # leases a request found without asking
        self._acquires: list[_Acquire] = []
        self._to_release: list[tuple[int, int]] = []  # (session epoch, handle)
        self._releases: list[Call] = []
        self._stats = OffloadingConnectorStats()
        self._identities: IdentitySource | None = None
        self._link.settle(spec.connect_timeout_s, (self._namespaces.id_for(SHA256_OFFLOAD_KEY_BYTES),))

    def use_identities(self, source: IdentitySource) -> None:
        """Hand each stored chunk's block identity (vLLM's tracker, identity.py) to the workers,
        which send it with the store."""
        self._identities = source

    @property
    def connected(self) -> bool:
        return self._link.ready

    # -- lookups ----------------------------------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._namespaces.on_new_request(req_context)
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._acquires:
            self._collect_acquires()
        namespace_id = self._namespace_of(key, req_context)
        probe_key = (namespace_id, key)
        req_id = req_context.req_id
        lease = self._leases.get(probe_key)
        if lease is not None and not (self._link.ready and lease.epoch == self._link.epoch) and lease.loads <= 0:
            del self._leases[probe_key]  # its session ended: the daemon freed it
            self._batcher.forget(probe_key)
            lease = None
        if lease is not None:
            lease.requests.add(req_id)
            self._req_leases.setdefault(req_id, set()).add(probe_key)
            return LookupResult.HIT
        if self._unusable():
            return LookupResult.MISS
        # A hit verdict without its lease is asked again by the batcher: only RETRY or MISS here.
        return LookupResult.RETRY if self._batcher.ask(namespace_id, key, req_context) is None else LookupResult.MISS

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        for probe_key in self._batcher.request_finished(req_id) | self._req_leases.pop(req_id, set()):
            lease = self._leases.get(probe_key)
            if lease is not None:
                lease.requests.discard(req_id)
                self._maybe_release(probe_key, lease)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._link.poll()
        self._forget_dead_pool()
        self._collect_acquires()
        self._flush_lookups()
        self._flush_releases()

    @override
    def has_pending_work(self) -> bool:
        return bool(self._acquires or self._batcher.queued or self._releases or self._to_release)

    # -- loads and stores -------------------------------------------------------------------

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        pool_ids, per_part = [], []
        for key in keys:
            lease = self._leases[(self._namespace_of(key, req_context), key)]  # a HIT of this step
            lease.loads += 1
            pool_ids.append(lease.pool_id)
            per_part.extend(lease.extents)
        key_bytes = len(next(iter(keys))) if keys else SHA256_OFFLOAD_KEY_BYTES
        return KvstoredLoadSpec(self._world, pool_ids, per_part, key_bytes, self._namespaces.salt_of(req_context))

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            probe_key = (self._namespace_of(key, req_context), key)
            lease = self._leases.get(probe_key)
            if lease is not None:
                lease.loads -= 1
                self._maybe_release(probe_key, lease)

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        to_store = [k for k in keys if (self._namespace_of(k, req_context), k) not in self._leases]
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=KvstoredStoreSpec(
                to_store,
                self._namespaces.salt_of(req_context),
                [self._identities(k) for k in to_store] if self._identities is not None else (),
            ),
            evicted_keys=[],
        )

    # -- the rest of the manager API ----------------------------------------------------------

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        stats, self._stats = self._stats, OffloadingConnectorStats()
        stats.set_gauge(DirectMetrics.LEASED_CHUNKS, len(self._leases))
        stats.set_gauge(DirectMetrics.CONNECTED, int(self._link.ready))
        return stats

    @override
    def shutdown(self) -> None:
        # Closing the session makes the daemon drop every lease it holds.
        self._link.close()

    # -- internals ----------------------------------------------------------------------------

    def _unusable(self) -> bool:
        if self._link.state is LinkState.DOWN and not self._link.poll():
            return self._link.state is LinkState.DOWN
        return False

    def _forget_dead_pool(self) -> None:
        """Once the session that holds leases is gone (the daemon restarted, or the link was
        reset), its idle leases are worthless: the daemon freed them, and their slots may hold
        other chunks by now. Drop them so lookups ask again. Leases of loads in flight stay until
        complete_load: the workers keep that pool mapped meanwhile."""
        current = self._link.epoch if self._link.ready else -1
        for probe_key in [k for k, lease in self._leases.items() if lease.epoch != current and lease.loads <= 0]:
            del self._leases[probe_key]
            self._batcher.forget(probe_key)  # a later lookup asks again

    def _namespace_of(self, key: OffloadKey, req_context: ReqContext) -> str:
        return self._namespaces.id_of(key, req_context)

    def _flush_lookups(self) -> None:
        self._batcher.flush(self._send_acquire, self._link.state is LinkState.DOWN, self._spec.lookup_timeout_s)
        now = time.monotonic()
        for call in self._acquires:
            if not call.expired and now - call.sent_at > self._spec.lookup_timeout_s:
                call.expired = True
                self._resolve(call.namespace_id, call.keys, 0)

    def _send_acquire(self, namespace_id: str, keys: list[OffloadKey], ctx: ReqContext | None) -> bool:
        if not self._link.namespace_ready(namespace_id):
            return False
        # Acquire answers a prefix: ask in token order when the scheduler recorded positions.
        positions: list[int] = []
        if ctx is not None:
            positions = [p for p in map(ctx.get_offload_key_position, keys) if p is not None]
        if len(positions) == len(keys):
            keys = [k for _, k in sorted(zip(positions, keys), key=lambda pk: pk[0])]
        parts = [part_key(k, r, self._world) for k in keys for r in range(self._world)]
        request = pb.AcquireRequest(session_id=self._link.session_id, namespace_id=namespace_id, keys=parts)
        # No deadline: a lease granted after a client timeout would be leaked; a slow answer
        # is turned into misses in _flush_lookups instead, and its leases released when it arrives.
        self._acquires.append(
            _Acquire(
                self._link.call("Acquire", request),
                namespace_id,
                keys,
                self._link.pool_id,
                self._link.epoch,
                time.monotonic(),
            )
        )
        self._stats.increase_counter(DirectMetrics.LOOKUP_RPCS)
        return True

    def _collect_acquires(self) -> None:
        pending = []
        for call in self._acquires:
            if not call.future.done():
                pending.append(call)
                continue
            result = outcome(call.future)
            if not result.ok:
                code = result.code.name if result.code else "UNKNOWN"
                self._stats.increase_counter(DirectMetrics.RPC_ERRORS, 1, (code,))
                self._link.on_rpc_error(result)
                if not call.expired:
                    self._resolve(call.namespace_id, call.keys, 0)
                continue
            leases = list(result.response.leases)
            if not (self._link.ready and call.epoch == self._link.epoch):
                # Answered in a session that has ended since: the daemon freed these leases, and
                # their pages may hold other chunks by now. A miss (asked again next time).
                if not call.expired:
                    self._resolve(call.namespace_id, call.keys, 0)
                continue
            whole = 0 if call.expired else len(leases) // self._world
            for i, key in enumerate(call.keys[:whole]):
                probe_key = (call.namespace_id, key)
                mine = leases[i * self._world : (i + 1) * self._world]
                probe = self._batcher.probe(probe_key)
                if probe_key in self._leases or probe is None or not probe.requests:
                    self._to_release.extend((call.epoch, lease.handle) for lease in mine)
                    continue
                arena = next((e.arena for lease in mine for e in lease.extents), 0)
                self._leases[probe_key] = _Lease(
                    arena_key(call.pool_id, arena),
                    call.epoch,
                    [lease.handle for lease in mine],
                    [[(e.offset, e.length) for e in lease.extents] for lease in mine],
                    requests=set(probe.requests),
                )
            self._to_release.extend((call.epoch, lease.handle) for lease in leases[whole * self._world :])
            if not call.expired:
                self._resolve(call.namespace_id, call.keys, whole)
        self._acquires = pending

    def _resolve(self, namespace_id: str, keys: list[OffloadKey], hits: int) -> None:
        """The first `hits` keys are leased (HIT), the rest are misses."""
        self._batcher.resolve(
            namespace_id, keys, [i < hits and (namespace_id, key) in self._leases for i, key in enumerate(keys)]
        )

    def _maybe_release(self, probe_key: ProbeKey[OffloadKey], lease: _Lease) -> None:
        if not lease.requests and lease.loads <= 0:
            del self._leases[probe_key]
            self._to_release.extend((lease.epoch, handle) for handle in lease.handles)

    def _flush_releases(self) -> None:
        self._releases = [f for f in self._releases if not f.done() or self._release_failed(f)]
        # Leases of an earlier session ended with it; their ids may name the new session's leases.
        handles = [h for epoch, h in self._to_release if self._link.ready and epoch == self._link.epoch]
        self._to_release.clear()
        if handles:
            self._releases.append(
                self._link.call("Release", pb.ReleaseRequest(session_id=self._link.session_id, handles=handles))
            )

    def _release_failed(self, future: Call) -> bool:
        result = outcome(future)
        if not result.ok:
            self._link.on_rpc_error(result)
        return False


# -- worker side ---------------------------------------------------------------------------------


class KvstoredOffloadingWorker(OffloadingWorker):
    """vLLM's OffloadingWorker over pool_worker.PoolTransferEngine."""

    def __init__(self, spec: KvstoredOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self._spec = spec
        layout = KVLayout(
            [t.tensor for t in kv_caches.tensors],
            [[LayerRef(r.tensor_idx, r.page_size_bytes) for r in refs] for refs in kv_caches.group_data_refs],
            spec.blocks_per_chunk,
            page_bytes=[t.page_size_bytes for t in kv_caches.tensors],
        )
        if layout.part_bytes != spec.part_bytes:  # (every store and load would fail on it)
            raise ValueError(
                f"kvstored direct spec: this worker's KV cache makes chunk parts of {layout.part_bytes} bytes "
                f"({len(layout.page_bytes)} tensors of {sorted(set(layout.page_bytes))} bytes per block, "
                f"{spec.blocks_per_chunk} blocks per chunk), but vLLM's config gives {spec.part_bytes} "
                f"({spec.part_bytes // spec.blocks_per_chunk} bytes per block): a KV cache layout this spec does "
                "not support"
            )
        self._engine = PoolTransferEngine(
            layout,
            spec.socket,
            f"vllm-worker-{spec.config.engine_id}-rank{spec.rank}-pid{os.getpid()}",
            connect_timeout_s=spec.connect_timeout_s,
            store_timeout_s=spec.store_timeout_s,
        )
        self._layout = layout

    @override
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvstoredStoreSpec)
        if not dst_spec.keys:
            self._engine.submit_store(job_id, src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices, "", [])
            return True
        ns_spec = self._spec.namespace_spec(len(dst_spec.keys[0]), dst_spec.cache_salt)
        namespace_id = self._engine.link.namespace(ns_spec)
        keys = [part_key(k, self._spec.rank, self._spec.world_size) for k in dst_spec.keys]
        # Rank 0's parts alone carry the identity: routers hear of each engine block once.
        blocks = dst_spec.blocks if self._spec.rank == 0 else ()
        self._engine.submit_store(
            job_id, src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices, namespace_id, keys, blocks
        )
        return True

    @override
    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        assert isinstance(src_spec, KvstoredLoadSpec)
        namespace_id = ""
        if src_spec.cache_salt:  # a tenant's chunks: its arena opens once the namespace is registered here
            ns_spec = self._spec.namespace_spec(src_spec.key_bytes, src_spec.cache_salt)
            namespace_id = self._engine.link.namespace(ns_spec)
        self._engine.submit_load(
            job_id,
            dst_spec.block_ids,
            dst_spec.group_sizes,
            dst_spec.block_indices,
            src_spec.pool_ids,
            src_spec.for_rank(self._spec.rank),
            expedited,
            namespace_id,
        )
        return True  # a failure is reported through get_finished()

    @override
    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(f.job_id, f.success, f.num_bytes, f.seconds) for f in self._engine.get_finished()]

    @override
    def wait(self, job_ids: set[int]) -> None:
        self._engine.wait(job_ids)

    def has_pending_work(self) -> bool:
        """Not part of vLLM's API: whether stores are still being committed (tests, shutdown)."""
        return self._engine.has_pending_work()

    @override
    def shutdown(self) -> None:
        self._engine.close()
