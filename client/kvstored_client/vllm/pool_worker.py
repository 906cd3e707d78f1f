# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The direct spec's worker engine: GPU blocks into the daemon's pool and back, polled, by job id.

vLLM-free (the GPU check drives it directly); `direct.KvstoredOffloadingWorker` adapts vLLM's
specs to it.

Store (GPU -> pool), per job:  Reserve (gRPC future) -> copies on the store stream, after the
compute stream's work that wrote those blocks -> done (vLLM may reuse the blocks) -> Commit.
A store is best effort: whatever goes wrong (daemon down, slow, full), the job is reported done and
nothing is committed. A reservation that answers after its job gave up is released, never copied
into: once a job is reported, its GPU blocks are not read again.

Load (pool -> GPU): the scheduler already holds leases on the chunks (its Acquire), and the spec
carries their extents and the pool's identity; the worker only copies.

A tenant namespace's chunks (a request's cache_salt) live in the tenant's own arena, which the
worker's session opens once it has registered the namespace; such arenas are mapped but not
pinned (pinning a sparse arena would allocate all of it, and the daemon returns its free pages
to the kernel, which a pin would silently keep), so their copies are staged by the driver. Leases come from one daemon
run; the worker keeps that run's pool mapped while loads use it, even if the daemon has restarted
meanwhile (the memory stays valid while mapped), so a lease is never read from a different pool.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client.ahead import AheadSlots
from kvstored_client.blocks import BlockIdentity
from kvstored_client.blocks import to_pb as blocks_pb
from kvstored_client.droplog import DropLog
from kvstored_client.kinds import DropReason
from kvstored_client.vllm.blockcopy import ChunkExtents, Copies, CudaRuntime, KVLayout, MappedPool, run_copies_cpu
from kvstored_client.vllm.driver import DaemonLink, LinkOptions, LinkState, arena_key, outcome

log = logging.getLogger(__name__)

_DROP_LABELS = {int(r): r.label for r in DropReason if r is not DropReason.NONE}
_DROP_WHY = {
    "unavailable": "the daemon was unreachable, or did not grant pool slots within kvstored_store_timeout_s",
    "error": "the daemon's Reserve call failed",
}


@dataclass(frozen=True)
class Finished:
    job_id: int
    success: bool
    num_bytes: int
    seconds: float


@dataclass
class _Store:
    job_id: int
    gpu_blocks: np.ndarray
    group_sizes: Sequence[int]
    block_indices: Sequence[int]
    namespace_id: str
    keys: list[bytes]
    submitted: float
    deadline: float
    blocks: Sequence[BlockIdentity | None] = ()  # block identities for the daemon's KV events
    ready_event: Any = None  # CUDA event on the compute stream at submit time
    reserve: Any = None  # a DaemonLink call (driver.Call)
    epoch: int = 0  # the link's session when Reserve was sent: its handles die with it
    pool_id: str = ""
    handles: list[int] = field(default_factory=list)
    end_event: Any = None
    num_bytes: int = 0
    copied: bool = False
    reported: bool = False
    dropped: str = ""  # why nothing was stored (a dropped_chunks reason); "" while it may be
    slot_drops: list[str] = field(default_factory=list)  # the daemon's reasons for slots it refused
    # Copied into slots reserved ahead: the keys (and their block identities) its Commit names.
    commit_keys: list[bytes] | None = None
    commit_blocks: list[BlockIdentity | None] = field(default_factory=list)


@dataclass
class _Load:
    job_id: int
    pool_ids: set[str]
    submitted: float
    namespace_id: str = ""  # a tenant namespace whose arena this worker must open first
    num_bytes: int = 0
    end_event: Any = None
    waiting: Any = None  # the copy to issue once its pool is mapped (after a daemon restart)
    deadline: float = 0.0


class PoolTransferEngine:
    def __init__(
        self,
        layout: KVLayout,
        socket_path: str,
        client_name: str,
        *,
        connect_timeout_s: float = 2.0,
        store_timeout_s: float = 2.0,
        retain_old_pool_s: float = 30.0,
        populate: bool = True,
    ) -> None:
        self.layout = layout
        self._store_timeout_s = store_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._populate = populate
        options = LinkOptions(connect_timeout_s=connect_timeout_s, rpc_timeout_s=connect_timeout_s)
        self.cuda = CudaRuntime() if layout.is_cuda else None
        self.link = DaemonLink(
            socket_path, client_name, keep_pool_fd=True, pins_pool=self.cuda is not None, options=options
        )
        if self.cuda is not None:
            import torch

            device = layout.tensors[0].device
            self._streams = {name: torch.cuda.Stream(device=device) for name in ("store", "load", "expedited")}
        self.pools: dict[str, MappedPool] = {}
        self._retired: dict[str, float] = {}  # pool id -> when a newer pool replaced it
        self._retain_old_pool_s = retain_old_pool_s
        self._stores: dict[int, _Store] = {}
        self._loads: dict[int, _Load] = {}
        self._rpcs: list[Any] = []  # Commit / Release futures: collected for errors only
        # Slots reserved ahead (per namespace, for the session of epoch _ahead_epoch): a store
        # copies into them at once, with no Reserve round trip, and its Commit names the keys.
        self._ahead = AheadSlots(enabled=True)
        self._ahead_epoch = -1
        self._refills: list[tuple[Any, str, int]] = []  # (Commit future, namespace, epoch): new slots ahead
        self.stores_ahead = 0  # store jobs that took slots reserved ahead (no Reserve)
        self._finished: list[Finished] = []
        self.dropped_stores = 0
        self.drop_log = DropLog(f"kvstored direct spec at {socket_path}")
        # Start-up: wait for the session so the first transfers find the pool mapped.
        self.link.settle(connect_timeout_s)
        self._map_current_pool()

    # -- stores -----------------------------------------------------------------------------

    def submit_store(
        self,
        job_id: int,
        gpu_blocks: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        namespace_id: str,
        keys: list[bytes],
        blocks: Sequence[BlockIdentity | None] = (),
    ) -> None:
        now = time.monotonic()
        if not keys:
            self._finished.append(Finished(job_id, True, 0, 0.0))
            return
        job = _Store(
            job_id,
            np.asarray(gpu_blocks),
            list(group_sizes),
            list(block_indices),
            namespace_id,
            keys,
            now,
            now + self._store_timeout_s,
            blocks,
        )
        if self.cuda is not None:
            import torch

            job.ready_event = torch.cuda.Event()
            job.ready_event.record(torch.cuda.current_stream(self.layout.tensors[0].device))
        self._stores[job_id] = job
        self.link.poll()  # notices a restarted daemon now, not after a failed Reserve
        self._map_current_pool()
        self._advance_store(job)

    def _advance_store(self, job: _Store) -> None:
        if job.reserve is None and not job.copied:
            if self.link.ready and self.link.pool_id in self.pools and self.link.namespace_ready(job.namespace_id):
                if not self._store_ahead(job):
                    # (slots ahead are used once the key index is mapped: asked for at once)
                    ahead = self._ahead.wanted(job.namespace_id, len(job.keys)) if self.link.serves_index else 0
                    request = pb.ReserveRequest(
                        session_id=self.link.session_id,
                        namespace_id=job.namespace_id,
                        keys=job.keys,
                        blocks=blocks_pb(job.blocks, len(job.keys)),
                        ahead=ahead,
                    )
                    job.reserve = self.link.call("Reserve", request)
                    job.pool_id, job.epoch = self.link.pool_id, self.link.epoch
            elif self.link.state is LinkState.DOWN or time.monotonic() > job.deadline:
                job.dropped = "unavailable"
                self._report_store(job)
                self._stores.pop(job.job_id)
                return
        if job.reserve is not None and not job.copied and job.reserve.done():
            self._reserved(job)
        if job.copied and not job.reported and (job.end_event is None or job.end_event.query()):
            committable = bool(job.handles) and self._same_session(job.epoch)
            if job.handles and not committable:
                job.dropped = "unavailable"  # the session that reserved them ended
            self._report_store(job)
            if committable and job.commit_keys is not None:
                request = pb.CommitRequest(
                    session_id=self.link.session_id,
                    handles=job.handles,
                    keys=job.commit_keys,
                    namespace_id=job.namespace_id,
                    blocks=blocks_pb(job.commit_blocks, len(job.commit_keys)) if job.blocks else [],
                    ahead=len(job.handles),
                )
                self._refills.append((self.link.call("Commit", request), job.namespace_id, job.epoch))
            elif committable:
                self._rpcs.append(
                    self.link.call("Commit", pb.CommitRequest(session_id=self.link.session_id, handles=job.handles))
                )
        if not job.reported and not job.copied and time.monotonic() > job.deadline:
            # Only before copies are issued: once they are, the job ends when they do.
            job.dropped = "unavailable"
            self._report_store(job)  # the reservation, when it answers, is released
        if job.reported and (job.copied or job.reserve is None or job.reserve.done()):
            if not job.copied and job.reserve is not None:
                self._release_reserved(job)
            self._stores.pop(job.job_id, None)

    def _store_ahead(self, job: _Store) -> bool:
        """Copy the job's chunks the daemon's RAM does not hold (its key index says which) into
        slots reserved ahead, at once; False (nothing done) without the index or enough slots."""
        self._sync_ahead()
        index = self.link.key_index(job.namespace_id)
        if index is None:
            return False
        todo = [i for i, held in enumerate(index.holds(job.keys)) if not held]
        slots = self._ahead.take(job.namespace_id, len(todo)) if todo else []
        if slots is None:
            return False
        self.stores_ahead += 1
        job.pool_id, job.epoch = self.link.pool_id, self.link.epoch
        job.handles = [slot.handle for slot in slots]
        job.commit_keys = [job.keys[i] for i in todo]
        job.commit_blocks = [job.blocks[i] for i in todo] if job.blocks else []
        per_chunk: list[list[tuple[int, int]]] = [[] for _ in job.keys]
        for slot, i in zip(slots, todo):
            per_chunk[i] = [(e.offset, e.length) for e in slot.extents]
        arena = slots[0].extents[0].arena if slots and slots[0].extents else 0
        self._copy_in(job, per_chunk, arena)
        if job.handles and job.dropped:  # (its arena is not mapped: nothing was copied)
            self._rpcs.append(
                self.link.call("Release", pb.ReleaseRequest(session_id=self.link.session_id, handles=job.handles))
            )
            job.handles = []
        return True

    def _sync_ahead(self) -> None:
        """Slots reserved ahead belong to one session: a new one starts with none."""
        if self._ahead_epoch != self.link.epoch:
            self._ahead.clear()
            self._ahead_epoch = self.link.epoch

    def _refilled(self) -> None:
        """Collect the Commits of stores into slots reserved ahead: their new slots join the rest."""
        still = []
        for future, namespace_id, epoch in self._refills:
            if not future.done():
                still.append((future, namespace_id, epoch))
                continue
            result = outcome(future)
            if not result.ok:
                self.link.on_rpc_error(result)
            elif self._same_session(epoch):
                self._sync_ahead()
                self._ahead.add(namespace_id, result.response.ahead)
        self._refills = still

    def _reserved(self, job: _Store) -> None:
        if not self._same_session(job.epoch):
            # The session that was granted these slots has ended: the daemon freed them and may
            # have handed them to another writer. Copy nothing.
            job.copied, job.dropped = True, "unavailable"
            return
        result = outcome(job.reserve)
        if not result.ok:
            self.link.on_rpc_error(result)
            job.copied, job.dropped = True, "error"  # nothing to copy
            return
        self._sync_ahead()
        self._ahead.add(job.namespace_id, result.response.ahead)
        if job.reported:
            return  # gave up already: _advance_store releases the slots
        slots = result.response.slots
        job.slot_drops = [
            _DROP_LABELS.get(s.drop_reason, "daemon_full")
            for s in slots
            if s.state in (pb.SLOT_STATE_NO_SPACE, pb.SLOT_STATE_IN_PROGRESS)
        ]
        per_chunk = [
            [(e.offset, e.length) for e in s.extents] if s.state == pb.SLOT_STATE_RESERVED else [] for s in slots
        ]
        job.handles = [s.handle for s in slots if s.state == pb.SLOT_STATE_RESERVED]
        arena = next((s.extents[0].arena for s in slots if s.state == pb.SLOT_STATE_RESERVED and s.extents), 0)
        self._copy_in(job, per_chunk, arena)

    def _copy_in(self, job: _Store, per_chunk: list[list[tuple[int, int]]], arena: int) -> None:
        """Issue the job's copies into its slots (per chunk: its extents; none: not copied)."""
        self._map_current_pool()  # a tenant arena opened since the Reserve was sent
        pool = self.pools.get(arena_key(job.pool_id, arena))
        if pool is None and job.handles:
            job.dropped = "unavailable"  # the arena its slots are in is not mapped
        if pool is None or not job.handles:
            job.copied = True  # (no handles: every chunk present already, or refused by the daemon)
            return
        copies = self.layout.copies(
            job.gpu_blocks,
            job.group_sizes,
            job.block_indices,
            ChunkExtents.from_lists(per_chunk),
            pool.address,
            to_pool=True,
        )
        job.num_bytes = copies.total_bytes
        job.end_event = self._run(copies, "store", job.ready_event)
        job.copied = True

    def _release_reserved(self, job: _Store) -> None:
        result = outcome(job.reserve)
        if result.ok:
            handles = [s.handle for s in result.response.slots if s.state == pb.SLOT_STATE_RESERVED]
            if handles and self._same_session(job.epoch):
                self._rpcs.append(
                    self.link.call("Release", pb.ReleaseRequest(session_id=self.link.session_id, handles=handles))
                )

    def _report_store(self, job: _Store) -> None:
        """Done for vLLM (a store is best effort); what was dropped, and why, is counted and logged."""
        if job.reported:
            return
        job.reported = True
        dropped = bool(job.dropped)
        if dropped:
            self.drop_log.record(job.dropped, len(job.keys), _DROP_WHY[job.dropped])
        else:  # (chunks present already are no drop)
            for reason, n in Counter(job.slot_drops).items():
                self.drop_log.record(reason, n, "the daemon's reason (its log says more: stores dropped ...)")
        if dropped or job.slot_drops:
            self.dropped_stores += 1
        self._finished.append(
            Finished(job.job_id, True, 0 if dropped else job.num_bytes, time.monotonic() - job.submitted)
        )

    # -- loads ------------------------------------------------------------------------------

    def submit_load(
        self,
        job_id: int,
        gpu_blocks: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        chunk_pools: Sequence[str],
        extents: ChunkExtents,
        expedited: bool = False,
        namespace_id: str = "",
    ) -> bool:
        """Start a load of chunks whose leases the scheduler holds; chunk i lives in pool
        chunk_pools[i] (an arena_key) at `extents`. namespace_id: the chunks' tenant namespace
        (registered here to open its arena). False when a pool is not mapped here (the job is
        then reported failed)."""
        now = time.monotonic()
        load = _Load(job_id, set(chunk_pools), now, namespace_id)
        load.waiting = (np.asarray(gpu_blocks), group_sizes, block_indices, np.asarray(chunk_pools), extents, expedited)
        self._loads[job_id] = load
        if not load.pool_ids <= set(self.pools):
            # The scheduler leased chunks of a daemon this worker has not reconnected to yet (a
            # restart), or of a tenant arena it has not opened yet: hold the load until it has,
            # within the connect timeout.
            load.deadline = now + self._connect_timeout_s
            self.link.reconnect_soon()
            self.link.poll()
            self._map_current_pool()
        return self._issue_load(load)

    def _issue_load(self, load: _Load) -> bool:
        """Start a waiting load whose pools are mapped; fail it once its deadline passed."""
        if not load.pool_ids <= set(self.pools) and load.namespace_id and self.link.ready:
            self.link.namespace_ready(load.namespace_id)  # registers it and opens its arena
            self._map_current_pool()
        if not load.pool_ids <= set(self.pools):
            if time.monotonic() > load.deadline:
                log.error(
                    "kvstored: load job %d reads pool(s) %s, which this worker could not map",
                    load.job_id,
                    load.pool_ids - set(self.pools),
                )
                del self._loads[load.job_id]
                self._finished.append(Finished(load.job_id, False, 0, 0.0))
                return False
            return True
        blocks, group_sizes, block_indices, pools, extents, expedited = load.waiting
        load.waiting = None
        for pool_id in sorted(load.pool_ids):
            mine = extents if len(load.pool_ids) == 1 else _only(extents, pools == pool_id)
            copies = self.layout.copies(
                blocks, group_sizes, block_indices, mine, self.pools[pool_id].address, to_pool=False
            )
            load.num_bytes += copies.total_bytes
            load.end_event = self._run(copies, "expedited" if expedited else "load", None)
        return True

    # -- polling ----------------------------------------------------------------------------

    def get_finished(self) -> list[Finished]:
        self.poll()
        finished, self._finished = self._finished, []
        return finished

    def poll(self) -> None:
        self.link.poll()
        self._map_current_pool()
        for job in list(self._stores.values()):
            self._advance_store(job)
        for load in [load for load in self._loads.values() if load.waiting is not None]:
            self._issue_load(load)
        for job_id in [
            j
            for j, load in self._loads.items()
            if load.waiting is None and (load.end_event is None or load.end_event.query())
        ]:
            load = self._loads.pop(job_id)
            self._finished.append(Finished(job_id, True, load.num_bytes, time.monotonic() - load.submitted))
        still = []
        for future in self._rpcs:
            if future.done():
                result = outcome(future)
                if not result.ok:
                    self.link.on_rpc_error(result)
            else:
                still.append(future)
        self._rpcs = still
        self._refilled()
        self._drop_old_pools()

    def has_pending_work(self) -> bool:
        """Jobs or Commit / Release calls still in flight (a reported store may still be committing)."""
        return bool(self._stores or self._loads or self._rpcs or self._refills)

    def wait(self, job_ids: set[int]) -> None:
        """Block until those jobs no longer read or write their GPU blocks."""
        while any(j in self._loads and self._loads[j].waiting is not None for j in job_ids):
            self.poll()  # a load waiting for its pool: issued or failed within the connect timeout
            time.sleep(0.001)
        for job_id in job_ids:
            load = self._loads.get(job_id)
            if load is not None and load.end_event is not None:
                load.end_event.synchronize()
        while any(j in self._stores and not self._stores[j].reported for j in job_ids):
            self.poll()
            for j in job_ids:
                job = self._stores.get(j)
                if job is not None and job.end_event is not None:
                    job.end_event.synchronize()
            time.sleep(0.0002)

    def close(self) -> None:
        self.wait(set(self._stores) | set(self._loads))
        for future in [*self._rpcs, *(f for f, _ns, _epoch in self._refills)]:  # last Commits / Releases: a
            # stopped daemon must not stall shutdown
            try:
                future.exception(timeout=self._connect_timeout_s)
            except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
                future.cancel()
        for pool in self.pools.values():  # unpinned before the session ends (the daemon keeps pinned memory)
            pool.close()
        self.pools.clear()
        self.link.close()

    # -- internals --------------------------------------------------------------------------

    def _run(self, copies: Copies, stream_name: str, after: Any) -> Any:
        if self.cuda is None:
            run_copies_cpu(copies)
            return None
        import torch

        stream = self._streams[stream_name]
        if after is not None:
            stream.wait_event(after)
        else:  # loads: after pending writes (e.g. zeroing) to their destination blocks
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.device(stream.device):
            self.cuda.copy_async(copies, stream.cuda_stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _same_session(self, epoch: int) -> bool:
        """Whether handles granted in session `epoch` are still ours (a new session means the
        daemon dropped them, or restarted: its handle ids may name someone else's slots)."""
        return self.link.ready and self.link.epoch == epoch

    def _map_current_pool(self) -> None:
        if not self.link.ready:
            return
        if self.link.pool_fd is not None and self.link.pool_id not in self.pools:
            self.pools[self.link.pool_id] = MappedPool(
                self.link.pool_fd, self.link.pool_bytes, self.link.pool_id, self.cuda, populate=self._populate
            )
        for arena, (fd, size) in self.link.arena_fds.items():
            key = arena_key(self.link.pool_id, arena)
            if key not in self.pools:  # sparse: neither populated nor pinned
                self.pools[key] = MappedPool(fd, size, key, None, populate=False)

    def _drop_old_pools(self) -> None:
        """Unmap pools of earlier daemon runs once unused for a while: the scheduler may still hand
        out leases of the old run until it notices the restart."""
        if len(self.pools) < 2:
            return
        now = time.monotonic()
        used = {p for j in self._loads.values() for p in j.pool_ids} | {j.pool_id for j in self._stores.values()}
        used |= {arena_key(j.pool_id, a) for j in self._stores.values() for a in self.link.arena_fds}
        current = {self.link.pool_id} | {arena_key(self.link.pool_id, a) for a in self.link.arena_fds}
        for key in current:
            self._retired.pop(key, None)
        for pool_id in [p for p in self.pools if p not in current]:
            retired = self._retired.setdefault(pool_id, now)
            if pool_id not in used and now - retired > self._retain_old_pool_s:
                self.pools.pop(pool_id).close()
                del self._retired[pool_id]


def _only(extents: ChunkExtents, keep: np.ndarray) -> ChunkExtents:
    """The same chunks, with the extents of those not kept removed (they are skipped)."""
    per_chunk = []
    for i in range(len(extents)):
        a, b = extents.starts[i], extents.starts[i + 1]
        per_chunk.append(
            list(zip(extents.ext_offsets[a:b].tolist(), extents.ext_lengths[a:b].tolist())) if keep[i] else []
        )
    return ChunkExtents.from_lists(per_chunk)
