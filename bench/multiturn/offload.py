# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The modelled engine's connection to a real daemon: stores its GPU's evictions, looks up and loads (one
timed call per run of the same tier), through a registered region or the pool mapping."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.buffers import ShmFile, populate
from bench.lib.call_latency import CallLatency, timed_call
from bench.multiturn.model import HEADER, TIERS, Model, Transfer, Workload


@dataclass
class LoadResult:
    hits: dict[str, int]  # chunks loaded, per tier
    seconds: dict[str, float]  # measured load time, per tier
    lookup_s: float
    looked_up: int  # chunks the lookup reported as a prefix hit
    loaded: int
    segments: list[tuple[str, float, int]]  # one per load call: (tier, measured seconds, chunks loaded)


class Offload:
    """The modelled engine's connection to kvstored: chunks of the workload's size in the model's real bytes,
    at most a last prompt's per call; the prefill rate registered with --register-rates (0: no gate)."""

    TIER_NAMES = {1: "ram", 2: "fs", 3: "s3", 4: "peer"}

    def __init__(self, socket: Path, w: Workload, m: Model) -> None:
        from kvstored_client import Client, LoadInto, NamespaceSpec

        chunk_bytes, max_chunks = w.chunk_tokens * m.kv_bytes_per_token, w.final_tokens // w.chunk_tokens
        self.client = Client(socket, deadline_s=120.0, client_name="bench-multiturn")
        self.ns = self.client.register_namespace(
            NamespaceSpec(
                model="bench/multiturn",
                dtype="scaled-bf16",
                chunk_bytes=chunk_bytes,
                layout="sim",
                block_tokens=w.chunk_tokens,
                prefill_tokens_per_s=m.gate_prefill_tokens_per_s,
            )
        )
        self.chunk_bytes, self.max_chunks = chunk_bytes, max_chunks
        self._noise = populate(np.random.default_rng(w.seed).integers(0, 256, chunk_bytes, dtype=np.uint8))
        span = max_chunks * chunk_bytes
        self._region = self._region_file = None
        self._load_into = LoadInto.POOL
        if m.transfer is Transfer.REGION:  # in a shared file, registered with the daemon
            self._region_file = ShmFile(2 * span + 4096, prefix="kvstored-bench-multiturn")
            whole = self._region_file.array
            self._region, self._load_into = self.client.register_region(self._region_file.path), LoadInto.REGION
        else:
            whole = populate(np.empty(2 * span + 4096, dtype=np.uint8))
        # stores' chunks, then loads', then the call floor's
        self._staging, self._out, self._floor_out = whole[:span], whole[span : 2 * span], whole[2 * span :]
        self.call_floor_s = self._calibrate_call_floor()
        self.store_s = 0.0
        self.store_counts = {"stored": 0, "already_present": 0, "dropped": 0}
        self.corrupt = 0
        self.latency = CallLatency()  # per call, as the client saw it (the calibration's untimed)
        # (conversation, chunk index) -> the chunk's block identity, for routers (nodes.identity_for)
        self.identity: Callable[[int, int], Any] | None = None

    def _calibrate_call_floor(self) -> float:
        """The fixed cost of one load call (its RPCs and client bookkeeping), measured with a 4 KiB chunk in a
        namespace of its own: charged once per call, the rest of a load's time per byte."""
        from kvstored_client import NamespaceSpec

        ns = self.client.register_namespace(
            NamespaceSpec(model="bench/multiturn-call-floor", dtype="u8", chunk_bytes=4096)
        )
        key, offset = b"\x01" * 32, 2 * self.max_chunks * self.chunk_bytes
        self._floor_out[:] = 1
        self._store(ns, [key], self._floor_out, offset)
        floor = median_call_s(lambda: self._load(ns, [key], self._floor_out, offset), 1, "call-floor calibration")
        self.client.delete(ns, [key])
        return floor

    def _store(self, ns, keys: Sequence[bytes], buf: np.ndarray, region_offset: int, blocks=None):
        """Store len(keys) chunks held in `buf` (which, in region mode, is the region at `region_offset`)."""
        if self._region is None:
            return self.client.store(ns, keys, buf, blocks)
        offsets = [region_offset + i * ns.chunk_bytes for i in range(len(keys))]
        return self.client.store_from_region(ns, self._region, keys, offsets, blocks=blocks)

    def _load(self, ns, keys: Sequence[bytes], out: np.ndarray, region_offset: int) -> int:
        if self._region is None:
            return self.client.load(ns, keys, out)
        offsets = [region_offset + i * ns.chunk_bytes for i in range(len(keys))]
        return self.client.load_to_region(ns, self._region, keys, offsets)

    def close(self) -> None:
        self.client.close()
        if self._region_file is not None:
            self._region_file.close()

    def stats(self) -> dict[str, dict[str, int]]:
        fields = (
            "read_bytes written_bytes loaded_chunks stored_chunks hits lookups evictions promotions writedowns "
            "dropped_dirty dropped_backpressure errors checksum_failures rejected_full used_bytes chunks "
            "skipped_slow_hits skipped_slow_writedowns rate_probes load_bytes_per_s"
        ).split()
        return {tier.name: {f: int(getattr(tier, f)) for f in fields} for tier in self.client.stats().tiers}

    def store(self, evicted: Sequence[tuple[bytes, int, int]]) -> None:
        """Store the chunks the GPU evicted, with real (scaled) bytes: a header naming the chunk, then noise."""
        cb = self.chunk_bytes
        for start in range(0, len(evicted), self.max_chunks):
            batch = evicted[start : start + self.max_chunks]
            n = len(batch)
            buf = self._staging[: n * cb].reshape(n, cb)
            buf[:, HEADER:] = self._noise[HEADER:]
            for row, (key, conv, index) in enumerate(batch):
                buf[row, :HEADER] = np.frombuffer(_header(key, conv, index), dtype=np.uint8)
            t0 = time.perf_counter()
            blocks = [self.identity(conv, index) for _, conv, index in batch] if self.identity else None
            result = self._store(self.ns, [k for k, _, _ in batch], buf, 0, blocks)
            self.latency.record("store", time.perf_counter() - t0)
            self.store_s += time.perf_counter() - t0
            for k in self.store_counts:
                self.store_counts[k] += getattr(result, k)

    def lookup_load(self, keys: Sequence[bytes], conv: int, first_index: int) -> LoadResult:
        """Look the keys up; load the leading hits, one timed call per run of the same tier."""
        t0 = time.perf_counter()
        found = self.client.lookup(self.ns, keys, load_into=self._load_into)
        lookup_s = time.perf_counter() - t0
        self.latency.record("lookup", lookup_s)
        hits, seconds = dict.fromkeys(TIERS, 0), dict.fromkeys(TIERS, 0.0)
        n = min(found.prefix_hits, self.max_chunks)
        tiers = [self.TIER_NAMES.get(int(t), "peer") for t in found.tiers[:n]]
        loaded, segments = 0, []
        cb = self.chunk_bytes
        while loaded < n:
            start, tier = loaded, tiers[loaded]
            end = next((i for i in range(start, n) if tiers[i] != tier), n)
            t1 = time.perf_counter()
            got = self._load(self.ns, keys[start:end], self._out[start * cb : end * cb], (self.max_chunks + start) * cb)
            elapsed = time.perf_counter() - t1
            self.latency.record("load", elapsed)
            seconds[tier] = seconds.get(tier, 0.0) + elapsed
            for i in range(start, start + got):  # wrong bytes are counted, never served as a hit
                if bytes(self._out[i * cb : i * cb + HEADER]) != _header(keys[i], conv, first_index + i):
                    self.corrupt += 1
                    break
                loaded += 1
            hits[tier] = hits.get(tier, 0) + loaded - start
            segments.append((tier, elapsed, loaded - start))
            if loaded < end:
                break  # evicted between lookup and load (or corrupt): the rest is prefilled
        return LoadResult(hits, seconds, lookup_s, n, loaded, segments)


def median_call_s(call: Callable[[], int], want: int, what: str, calls: int = 40) -> float:
    """The median seconds of `calls` calls, the first quarter left out (warm-up); each must answer `want`."""
    timed = timed_call(lambda _: call(), lambda got: got == want, f"{what}: the chunks are not where they were put")
    return float(np.median([timed() for _ in range(calls)][calls // 4 :]))


def _header(key: bytes, conv: int, index: int) -> bytes:
    return key + conv.to_bytes(8, "little") + index.to_bytes(8, "little")
