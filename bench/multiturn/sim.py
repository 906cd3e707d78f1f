# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The modelled GPUs on a model clock: prefix caches, a loader beside each GPU, turns served first come
first served; loads and stores go to real daemons (Offload) and are charged what they measured."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.multiturn.model import COST_WINDOW, TIERS, VOCAB, Model, Workload
from bench.multiturn.offload import Offload

Segments = Sequence[tuple[str, float, int]]  # a turn's load calls: (tier, measured seconds, chunks loaded)


class GpuCache:
    """Chunks resident on the modelled GPU, least recently used first."""

    def __init__(self, capacity_chunks: int) -> None:
        self.capacity = capacity_chunks
        self._lru: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        return sum(1 for _ in itertools.takewhile(self._lru.__contains__, keys))

    def admit(self, keys: Sequence[bytes], conv: int) -> list[tuple[bytes, int, int]]:
        """Make the prompt's chunks resident (tail first, so the prefix is most recent); returns the evicted
        chunks as (key, conversation, index)."""
        for index, key in reversed(list(enumerate(keys))):  # (re)inserted last: most recent, its owner kept
            self._lru[key] = self._lru.pop(key, (conv, index))
        evicted = []
        while len(self._lru) > self.capacity:
            key, (c, i) = self._lru.popitem(last=False)
            evicted.append((key, c, i))
        return evicted


@dataclass
class TurnRecord:
    conv: int
    turn: int
    arrive: float
    prompt_tokens: int
    reusable_chunks: int
    hits: dict[str, int] = field(default_factory=dict)
    prefill_s: float = 0.0
    done: float = 0.0
    load_seconds: dict[str, float] = field(default_factory=dict)  # measured, per tier
    node: int = 0  # with several nodes: the one it is routed to


@dataclass
class Lane:
    """One node's loader and GPU: first come, first served each."""

    loader_q: list[TurnRecord] = field(default_factory=list)
    gpu_q: list[TurnRecord] = field(default_factory=list)
    loader_busy: bool = False
    gpu_busy: bool = False
    loader_s: float = 0.0
    gpu_s: float = 0.0


def run_clock(
    w: Workload,
    serial_loads: bool,
    starts: np.ndarray,
    thinks: np.ndarray,
    lanes: Sequence[Lane],
    route: Callable[[int, int], int],
    serve: Callable[[TurnRecord], float],
) -> tuple[list[TurnRecord], float]:
    """The discrete-event model clock: conversations arrive at `starts`, each turn goes to the lane `route`
    names, through its loader (`serve` returns the load time to charge) beside its GPU (--serial-loads: on
    the GPU's timeline), then thinks. Returns the finished turns and the makespan."""
    events: list[tuple[float, int, str, Any]] = []
    records: list[TurnRecord] = []
    seq = itertools.count()
    now = 0.0

    def push(t: float, kind: str, payload: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    def start_loader(lane: Lane) -> None:  # loads beside compute
        if lane.loader_busy or not lane.loader_q:
            return
        rec = lane.loader_q.pop(0)
        load_s = serve(rec)
        lane.loader_busy = True
        lane.loader_s += load_s
        push(now + load_s, "loaded", rec)

    def start_gpu(lane: Lane) -> None:
        if lane.gpu_busy or not lane.gpu_q:
            return
        rec = lane.gpu_q.pop(0)
        service = serve(rec) + rec.prefill_s if serial_loads else rec.prefill_s  # serial: the GPU waits for its loads
        lane.gpu_busy = True
        lane.gpu_s += service
        push(now + service, "computed", rec)

    for conv in range(len(starts)):
        push(float(starts[conv]), "arrive", (conv, 1))
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            conv, turn = payload
            rec = TurnRecord(conv, turn, now, w.prompt_tokens(turn), w.reusable_chunks(turn), node=route(conv, turn))
            lane = lanes[rec.node]
            (lane.gpu_q if serial_loads else lane.loader_q).append(rec)  # serial: loads on the GPU's timeline
            start_loader(lane)
            start_gpu(lane)
        elif kind == "loaded":
            lane = lanes[payload.node]
            lane.loader_busy = False
            lane.gpu_q.append(payload)
            start_loader(lane)
            start_gpu(lane)
        else:  # computed
            lane = lanes[payload.node]
            lane.gpu_busy = False
            payload.done = now
            records.append(payload)
            if payload.turn < w.turns:
                push(now + float(thinks[payload.conv, payload.turn]), "arrive", (payload.conv, payload.turn + 1))
            start_gpu(lane)
            start_loader(lane)
    return records, now


class Simulation:
    """One node's modelled GPU and loader on the model clock, its offload target a real daemon (or none)."""

    hit_tiers: tuple[str, ...] = TIERS  # where a reusable chunk can be found

    def __init__(self, w: Workload, m: Model, n: int, offload: Offload | None) -> None:
        self.w, self.m, self.n, self.offload = w, m, n, offload
        self.gpu = GpuCache(m.gpu_tokens // w.chunk_tokens)
        ns_id = offload.ns.namespace_id if offload else "no-offload"
        self.keys = [_conversation_keys(w, c, ns_id) for c in range(n)]
        # per conversation, fixed in advance: its start and think times (unlike the order turns are served in)
        rng = np.random.default_rng([w.seed, 1])
        self.starts = rng.uniform(0.0, w.think_s, n) if w.think_s > 0 else np.zeros(n)
        self.thinks = rng.uniform(0.5, 1.5, (n, w.turns)) * w.think_s
        self.lookup_s: list[float] = []
        self.load_calls = 0
        self.shortfall = 0
        self.cost_per_byte: dict[str, deque[float]] = {}
        self.all_costs: dict[str, list[float]] = {}
        self.charged: dict[str, float] = {}
        self.charged_fixed: dict[str, float] = {}

    def run(self) -> None:
        self.lane = Lane()
        self.records, self.makespan = run_clock(
            self.w, self.m.serial_loads, self.starts, self.thinks, [self.lane], lambda conv, turn: 0, self.serve_load
        )

    def charge(self, tier: str, seconds: float, chunks: int) -> float:
        """Modelled time of one load call: its fixed cost (measured at start) once, plus its bytes x the byte
        scale x the tier's cost per byte: the median over its last COST_WINDOW calls of (time - fixed) / bytes."""
        self.load_calls += 1
        assert self.offload is not None
        floor = self.offload.call_floor_s
        if chunks == 0:
            charged = fixed = seconds  # a call that found nothing: its time as measured
        else:
            nbytes = chunks * self.offload.chunk_bytes
            window = self.cost_per_byte.setdefault(tier, deque(maxlen=COST_WINDOW))
            window.append(max(0.0, seconds - floor) / nbytes)
            self.all_costs.setdefault(tier, []).append(window[-1])
            fixed = floor
            charged = floor + float(np.median(window)) * nbytes * self.m.byte_scale
        self.charged[tier] = self.charged.get(tier, 0.0) + charged
        self.charged_fixed[tier] = self.charged_fixed.get(tier, 0.0) + fixed
        return charged

    def serve_load(self, rec: TurnRecord) -> float:
        """The turn reaches the loader: GPU prefix, then kvstored for the rest; then store_after. Returns
        the load time to charge (0 when nothing comes from kvstored)."""
        w = self.w
        keys = self.keys[rec.conv][: rec.prompt_tokens // w.chunk_tokens]
        reusable = keys[: rec.reusable_chunks]
        on_gpu = self.gpu.prefix_hits(reusable)
        rec.hits = dict.fromkeys(self.hit_tiers, 0) | {"gpu": on_gpu}
        load_s = 0.0
        if self.offload is not None and on_gpu < len(reusable):
            res = self.offload.lookup_load(reusable[on_gpu:], rec.conv, on_gpu)
            self.lookup_s.append(res.lookup_s)
            self.shortfall += res.looked_up - res.loaded
            rec.hits |= {tier: rec.hits.get(tier, 0) + count for tier, count in res.hits.items()}
            lookup_s, segments = self._segments(res.lookup_s, res.segments)
            load_s = lookup_s + sum(self.charge(*seg) for seg in segments)
            rec.load_seconds = res.seconds
        cached = sum(rec.hits.values())
        rec.prefill_s = (rec.prompt_tokens - cached * w.chunk_tokens) / self.m.prefill_tokens_per_s
        self.store_after(keys, rec.conv, cached)
        return load_s

    def _segments(self, lookup_s: float, segments: Segments) -> tuple[float, Segments]:
        """The measured lookup and load calls, as they are charged (here: as measured)."""
        return lookup_s, segments

    def store_after(self, keys: Sequence[bytes], conv: int, cached: int) -> None:
        """The prompt becomes resident on the GPU: what that evicts is stored into kvstored."""
        evicted = self.gpu.admit(keys, conv)
        if self.offload is not None and evicted:
            self.offload.store(evicted)


def _conversation_keys(w: Workload, conv: int, namespace_id: str) -> list[bytes]:
    from kvstored_client import chunk_keys

    tokens = np.random.default_rng([w.seed, conv, 0]).integers(0, VOCAB, w.final_tokens, dtype=np.int64)
    return chunk_keys(tokens, w.chunk_tokens, namespace_id)
