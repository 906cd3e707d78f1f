# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstored as a vLLM secondary tier vs vLLM's built-in fs tier, through vLLM's own
TieringOffloadingManager on CPU (vllm==0.33.0; run tests/vllm/install_vllm.sh first).

Method, baselines, targets and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from bench.lib.call_latency import CallLatency
from bench.lib.daemons import Daemon
from bench.lib.limits import drop_page_cache, memcpy_gib_s, raw_odirect
from bench.lib.report import GIB, MIB, Row, load_average, machine_info, print_table, write_json

try:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
except ImportError as exc:
    sys.exit(f"vllm_tier.py needs vllm==0.33.0: run tests/vllm/install_vllm.sh ({exc})")

from kvstored_client.vllm.plugin import register  # noqa: E402

END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
BLOCKS_PER_CHUNK = 4
HANG_GUARD_S = 600.0
STEP_S = 0.001  # pause between scheduler steps (a model step runs meanwhile); --step-ms


def parse_size(text: str) -> int:
    """A size in bytes; k, m, g are binary here (2m: a 2 MiB chunk), as KiB, MiB, GiB are."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "": 1}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    return int(float(num) * units[t[len(num) :]])


def tag(key: bytes) -> np.uint64:
    return np.frombuffer(key[:8], dtype=np.uint64)[0]


class Engine:
    """Scheduler-side manager of one vLLM engine, driven like OffloadingConnectorScheduler."""

    def __init__(self, tier: dict, primary_bytes: int, chunk_bytes: int, latency: CallLatency) -> None:
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers",), group_id=0),),
            worker_kv_bytes_per_block=chunk_bytes // BLOCKS_PER_CHUNK,
            enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": primary_bytes, "secondary_tiers": [tier]},
            engine_id=f"bench-{uuid.uuid4().hex[:8]}",
            model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        )
        self.manager: Any = cast(Any, TieringOffloadingSpec(config).get_manager())  # a TieringOffloadingManager
        # the kvstored tiers' links to the daemon: their calls are timed (issue to answer)
        self.tiers = [t for t in self.manager.secondary_tiers if hasattr(t, "link")]
        self.links = [t.link for t in self.tiers]
        for link in self.links:
            latency.watch(link)
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint64)
        self.base = np.arange(self.rows.shape[1], dtype=np.uint64)
        self.rows[:] = self.base  # every page touched before timing

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(END)
        time.sleep(STEP_S)  # the model step: the tier's I/O threads and the daemon run meanwhile

    def _requests(self, keys: list[bytes], batch: int) -> Iterator[tuple[ReqContext, list[bytes]]]:
        """One new request per `batch` keys."""
        for first in range(0, len(keys), batch):
            ctx = ReqContext(req_id=uuid.uuid4().hex)
            with self.manager.lock:
                self.manager.on_new_request(ctx)
            yield ctx, keys[first : first + batch]

    def store(self, keys: list[bytes], batch: int) -> tuple[float, float]:
        """Returns (wall seconds, seconds spent writing payloads into the primary region)."""
        fill = 0.0
        start = time.perf_counter()
        for ctx, chunk in self._requests(keys, batch):
            while True:
                with self.manager.lock:
                    out = self.manager.prepare_store(chunk, ctx)
                if out is not None:
                    break
                self.step()  # the primary is full of chunks still cascading
                self._guard(start)
            # vLLM's GPU -> primary copy is DMA: only each chunk's first and last words (its identity) are written
            t = time.perf_counter()
            for key, row in zip(out.keys_to_store, out.store_spec.chunk_ids):
                self.rows[row, 0] = tag(key)
                self.rows[row, -1] = self.base[-1] ^ tag(key)
            fill += time.perf_counter() - t
            with self.manager.lock:
                self.manager.complete_store(out.keys_to_store, ctx)
                self.manager.on_request_finished(ctx)
                self.manager.on_schedule_end(END)
        while self.manager.has_pending_work():
            self.step()
            self._guard(start)
        return time.perf_counter() - start, fill

    def load(self, keys: list[bytes], batch: int) -> tuple[float, int, int]:
        """Returns (wall seconds, chunks loaded and verified, chunks missed)."""
        loaded = missed = 0
        start = time.perf_counter()
        for ctx, chunk in self._requests(keys, batch):
            while True:
                with self.manager.lock:
                    answers = [self.manager.lookup(k, ctx) for k in chunk]
                    self.manager.on_schedule_end(END)
                if all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers):
                    break
                time.sleep(STEP_S)
                self._guard(start)
            hits = [k for k, a in zip(chunk, answers) if a is LookupResult.HIT]
            missed += len(chunk) - len(hits)
            with self.manager.lock:
                spec = self.manager.prepare_load(hits, ctx)
            for key, row in zip(hits, spec.chunk_ids):
                r = self.rows[row]
                if r[0] != tag(key) or r[-1] != (self.base[-1] ^ tag(key)):
                    raise AssertionError(f"chunk {key.hex()[:12]} came back with other bytes")
            loaded += len(hits)
            with self.manager.lock:
                self.manager.complete_load(hits, ctx)
                self.manager.on_request_finished(ctx)
        return time.perf_counter() - start, loaded, missed

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()

    @staticmethod
    def _guard(start: float) -> None:
        if time.perf_counter() - start > HANG_GUARD_S:
            raise RuntimeError("the offloading manager made no progress")


def daemon_tiers(daemon: Daemon) -> dict:
    return {t.name: t for t in daemon.stats().tiers}


def run_case(name: str, tier: dict, args, keys: list[bytes], daemon: Daemon | None = None) -> dict:
    """vLLM stores the working set through one engine, then a restarted engine (empty primary) loads it."""
    latency = CallLatency()
    writer = Engine(tier, args.primary, args.chunk, latency)
    store_s, fill_s = writer.store(keys, args.store_batch)
    with writer.manager.lock:
        failures = writer.manager.get_stats().data["data"].get("vllm:kv_offload_tiering_cascade_job_failures", {})
    if sum(failures.values()):
        print(f"  {name}: {sum(failures.values())} cascade jobs failed", flush=True)
    transports = _transports(writer)
    writer.close()
    below = daemon_tiers(daemon).get("fs") if daemon is not None else None
    cold = drop_page_cache()
    reader = Engine(tier, args.primary, args.chunk, latency)
    load_s, loaded, missed = reader.load(keys, args.load_batch)
    transports = [a + b for a, b in zip(transports, _transports(reader))]
    local = sum(t.local_hits for t in (*writer.tiers, *reader.tiers))
    reader.close()
    result = {
        "name": name,
        "store_gib_s": len(keys) * args.chunk / (store_s - fill_s) / GIB,
        "store_s": store_s,
        "fill_s": fill_s,
        "load_gib_s": loaded * args.chunk / load_s / GIB,
        "load_s": load_s,
        "loaded": loaded,
        "missed": missed,
        "page_cache_dropped": cold,
        "load_average": load_average(),
        "call_latency_ms": latency.summary(),
        "calls_fast_grpc": transports,
        "lookups_from_key_index": local,
    }
    extra = ""
    if below is not None and daemon is not None:
        after = daemon_tiers(daemon)
        staged, read = daemon.stats().staged_chunks, after["fs"].loaded_chunks - below.loaded_chunks
        result["daemon_after_store"] = {
            "fs_chunks": below.chunks,
            "fs_dropped_backpressure": below.dropped_backpressure,
        }
        result["daemon_after_load"] = {"staged_chunks": staged, "fs_chunks_read": read}
        extra = (
            f"; daemon after store: fs {below.chunks} chunks ({below.dropped_backpressure} dropped by its queue), "
            f"RAM {after['ram'].chunks}; load: {read} from disk, {staged} staged"
        )
    print(
        f"  {name:14s} store {result['store_gib_s']:6.2f} GiB/s   load {result['load_gib_s']:6.2f} GiB/s"
        f"   ({loaded} loaded and verified, {missed} missed{extra}; load avg {result['load_average']:.2f})",
        flush=True,
    )
    if writer.links:
        over = f"{transports[0]} fast path, {transports[1]} gRPC calls, {local} lookups answered from the key index"
        latency.print(f"  {name}: per-call latency at the tier", over)
    return result


def _transports(engine: Engine) -> list[int]:
    """[calls over the fast path, calls over gRPC] by the engine's kvstored tiers."""
    counters = [link.counters for link in engine.links]
    return [sum(c.fast_calls for c in counters), sum(c.grpc_calls for c in counters)]


def _cold_load_bound(r: dict, chunk: int, limits: dict, fs_load_gib_s: float) -> str:
    """The fastest the cold load could be here: its chunks from disk at the raw O_DIRECT read rate, the rest at
    memcpy speed."""
    from_disk = r["daemon_after_load"]["fs_chunks_read"] * chunk
    from_ram = max(0, r["loaded"] * chunk - from_disk)
    seconds = from_disk / (limits["odirect_read_gib_s"] * GIB) + from_ram / (limits["memcpy_gib_s"] * GIB)
    bound = r["bound_gib_s"] = r["loaded"] * chunk / seconds / GIB
    return (
        f"bound ({r['daemon_after_load']['fs_chunks_read']} chunks at raw read, the rest at memcpy) "
        f"{bound:.2f} GiB/s = {bound / fs_load_gib_s:.2f}x vLLM fs, reached {r['load_gib_s'] / bound:.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--working-set", type=parse_size, default=1 << 30)
    parser.add_argument("--primary", type=parse_size, default=256 << 20, help="vLLM's CPU tier (cpu_bytes_to_use)")
    parser.add_argument("--daemon-ram", type=parse_size, default=256 << 20, help="the cold case's daemon RAM tier")
    parser.add_argument("--chunk", type=parse_size, default=2 << 20)
    parser.add_argument("--store-batch", type=int, default=32, help="chunks per request when storing")
    parser.add_argument("--load-batch", type=int, default=64, help="chunks per request when loading")
    parser.add_argument("--step-ms", type=float, default=1.0, help="pause between scheduler steps")
    parser.add_argument("--disk-depth", type=int, default=8, help="queue depth of the raw O_DIRECT limit")
    parser.add_argument("--cases", default="fs,ram,cold", help="which runs (fs is the baseline of the others)")
    parser.add_argument("--dir", type=Path, default=None, help="where both fs tiers write (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    for flag, batch in (("--store-batch", args.store_batch), ("--load-batch", args.load_batch)):
        # A request must fit in vLLM's CPU tier at once: its promotions wait for room that never frees.
        if batch < 1 or batch * args.chunk > args.primary:
            parser.error(
                f"{flag} {batch} x {args.chunk / MIB:.0f} MiB chunks does not fit vLLM's CPU tier "
                f"(--primary {args.primary / MIB:.0f} MiB); use at most {args.primary // args.chunk}"
            )
    global STEP_S
    STEP_S = args.step_ms / 1000
    logging.basicConfig(level=logging.WARNING)
    register()
    cases = set(args.cases.split(","))
    n = args.working_set // args.chunk
    keys: list[bytes] = [make_offload_key(hashlib.sha256(f"bench/{i}".encode()).digest(), 0) for i in range(n)]
    root = Path(tempfile.mkdtemp(prefix="vllm-tier-bench-", dir=args.dir))
    load0 = load_average()
    print(
        f"working set {n} x {args.chunk / MIB:.0f} MiB = {n * args.chunk / GIB:.2f} GiB; vLLM CPU tier "
        f"{args.primary / MIB:.0f} MiB; cold daemon RAM {args.daemon_ram / MIB:.0f} MiB; disk: {root}; "
        f"load average {load0:.2f}",
        flush=True,
    )
    results: dict = {}
    try:
        disk = raw_odirect(root, min(n, 256), args.chunk, args.disk_depth)
        memcpy = memcpy_gib_s()
        print(
            f"  limits: raw O_DIRECT write {disk.write_gib_s:.2f} / read {disk.read_gib_s:.2f} GiB/s "
            f"(queue depth {disk.queue_depth}), memcpy {memcpy:.2f} GiB/s",
            flush=True,
        )
        results["limits"] = {
            "odirect_write_gib_s": disk.write_gib_s,
            "odirect_read_gib_s": disk.read_gib_s,
            "queue_depth": disk.queue_depth,
            "memcpy_gib_s": memcpy,
        }
        results["fs"] = run_case("fs", {"type": "fs", "root_dir": str(root / "vllm-fs")}, args, keys)
        shutil.rmtree(root / "vllm-fs", ignore_errors=True)
        if "ram" in cases:
            with Daemon(int(args.working_set * 1.25) + (64 << 20), log_level="warning") as daemon:
                tier = {"type": "kvstored", "socket": str(daemon.socket)}
                results["kvstored_ram"] = run_case("kvstored RAM", tier, args, keys)
        if "cold" in cases:  # daemon RAM below the working set, write-back to its fs tier; the load reads its disk
            fs_args = ["--tiers", f"kind=fs,root={root / 'kvstored-fs'},bytes={2 * args.working_set}"]
            with Daemon(args.daemon_ram, log_level="warning", extra_args=fs_args) as daemon:
                tier = {"type": "kvstored", "socket": str(daemon.socket)}
                results["kvstored_cold"] = run_case("kvstored cold", tier, args, keys, daemon)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    fs, limits = results["fs"], results["limits"]
    rows = []
    for key, label, targets in (
        ("kvstored_ram", "kvstored (RAM)", (3.0, 3.0)),
        ("kvstored_cold", "kvstored (cold: RAM < working set, fs write-back)", (1.0, 1.5)),
    ):
        if (r := results.get(key)) is None:
            continue
        for op, target in zip(("store", "load"), targets):
            value = r[f"{op}_gib_s"]
            if key == "kvstored_ram":
                note = f"memcpy {limits['memcpy_gib_s']:.2f} GiB/s: {value / limits['memcpy_gib_s']:.2f}x"
            else:
                limit = limits["odirect_write_gib_s" if op == "store" else "odirect_read_gib_s"]
                note = f"raw O_DIRECT {op} {limit:.2f} GiB/s (depth {limits['queue_depth']}): {value / limit:.2f}x"
            if key == "kvstored_cold" and op == "load" and "daemon_after_load" in r:
                note += "; " + _cold_load_bound(r, args.chunk, limits, fs["load_gib_s"])
            if r["missed"] and op == "load":
                note += f"; {r['missed']} chunks missed"
            rows.append(Row(f"{label} {op}", value, "GiB/s", f"vLLM fs {op}", fs[f"{op}_gib_s"], target, note=note))
    print()
    print_table(rows, title="vLLM TieringOffloadingManager, secondary tier throughput (same run, same disk)")
    if not all(r.get("page_cache_dropped", True) for r in results.values()):
        print("  note: could not drop the page cache (not root): loads may be served from it")
    print(f"load average {load0:.2f} at start, {load_average():.2f} at end")
    if args.json:
        load = {"start": load0, "end": load_average()}
        rows_json = [r.to_json() for r in rows]
        write_json(args.json, {"machine": machine_info(), "results": results, "rows": rows_json, "load_average": load})
    return 0


if __name__ == "__main__":
    sys.exit(main())
