"""kvstored as a vLLM secondary tier vs vLLM's built-in fs tier, through vLLM's own
TieringOffloadingManager on CPU (vllm==0.33.0; run tests/vllm/install_vllm.sh first).

    .venv/bin/python bench/vllm_tier.py [--working-set 1GiB] [--primary 256MiB] [--chunk 2MiB]
                                        [--dir DIR] [--json out.json]

A working set larger than vLLM's CPU (primary) tier is stored (GPU -> primary -> cascade to the
secondary tier), then loaded back by a restarted engine (lookup -> promotion from the secondary
tier into the primary region -> HIT), batch after batch, the way the scheduler drives the manager.
Rates are working-set bytes over wall time. The GPU -> primary copy (DMA in vLLM) is not
simulated beyond stamping each chunk's first and last words with its identity (pages are touched
before timing); the load time counts the promotion into the primary region, and every loaded
chunk's identity is checked.

Three runs, one process, one disk (--dir):
  fs          vLLM's fs tier (O_DIRECT where the filesystem allows it), cold page cache on load
  kvstored    the daemon keeps the working set in RAM                        target >= 3x fs
  kvstored    the daemon writes through to its own fs tier, then restarts (RAM empty) and the
  cold        page cache is dropped before the load: it reads its fs tier        target >= 1x fs
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import GIB, MIB, Daemon, Row, machine_info, print_table, write_json  # noqa: E402

try:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig, OffloadingModelConfig,
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
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "": 1}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    return int(float(num) * units[t[len(num):]])


def keys_for(n: int) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"bench/{i}".encode()).digest(), 0) for i in range(n)]


def tag(key: bytes) -> np.uint64:
    return np.frombuffer(key[:8], dtype=np.uint64)[0]


class Engine:
    """Scheduler-side manager of one vLLM engine, driven like OffloadingConnectorScheduler."""

    def __init__(self, tier: dict, primary_bytes: int, chunk_bytes: int) -> None:
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
        self.manager = TieringOffloadingSpec(config).get_manager()
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint64)
        self.base = np.arange(self.rows.shape[1], dtype=np.uint64)
        self.rows[:] = self.base  # every page touched before timing

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(END)
        time.sleep(STEP_S)  # the model step: the tier's I/O threads and the daemon run meanwhile

    def store(self, keys: list[bytes], batch: int) -> tuple[float, float]:
        """Returns (wall seconds, seconds spent writing payloads into the primary region)."""
        fill = 0.0
        start = time.perf_counter()
        for first in range(0, len(keys), batch):
            ctx = ReqContext(req_id=uuid.uuid4().hex)
            chunk = keys[first:first + batch]
            with self.manager.lock:
                self.manager.on_new_request(ctx)
            while True:
                with self.manager.lock:
                    out = self.manager.prepare_store(chunk, ctx)
                if out is not None:
                    break
                self.step()  # the primary is full of chunks still cascading
                self._guard(start)
            # The GPU -> primary copy is DMA in vLLM (no CPU): here only each chunk's first and
            # last words are written (its identity, checked on load), so the CPU stays with the tiers.
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
        for first in range(0, len(keys), batch):
            ctx = ReqContext(req_id=uuid.uuid4().hex)
            chunk = keys[first:first + batch]
            with self.manager.lock:
                self.manager.on_new_request(ctx)
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


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def daemon_tiers(daemon: Daemon) -> dict:
    import grpc

    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        return {t.name: t for t in pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=10).tiers}


def wait_written_down(daemon: Daemon, n: int) -> int:
    """Until the daemon's fs tier has nothing queued (a stop abandons the queue); returns its chunks."""
    deadline = time.monotonic() + HANG_GUARD_S
    last = -1
    while True:
        fs = daemon_tiers(daemon)["fs"]
        if fs.queued == 0 and (fs.chunks >= n or fs.chunks == last):
            if fs.chunks < n:
                print(f"  the daemon's fs tier holds {fs.chunks} of {n} chunks "
                      f"(dropped: {fs.dropped_backpressure} by its queue)", flush=True)
            return fs.chunks
        last = fs.chunks
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon's fs tier never drained ({fs.chunks} of {n} chunks)")
        time.sleep(0.01)


def run_case(name: str, tier: dict, args, keys: list[bytes], between=None) -> dict:
    writer = Engine(tier, args.primary, args.chunk)
    store_s, fill_s = writer.store(keys, args.store_batch)
    with writer.manager.lock:
        failures = writer.manager.get_stats().data["data"].get("vllm:kv_offload_tiering_cascade_job_failures", {})
    if sum(failures.values()):
        print(f"  {name}: {sum(failures.values())} cascade jobs failed", flush=True)
    writer.close()
    durable_s = store_s - fill_s
    if between is not None:
        durable_s += between()  # seconds until the stored chunks were on the daemon's disk
    cold = drop_page_cache()
    reader = Engine(tier, args.primary, args.chunk)  # a vLLM restart: empty primary tier
    load_s, loaded, missed = reader.load(keys, args.load_batch)
    reader.close()
    total = len(keys) * args.chunk
    result = {
        "name": name, "store_gib_s": total / (store_s - fill_s) / GIB, "store_s": store_s, "fill_s": fill_s,
        "load_gib_s": loaded * args.chunk / load_s / GIB, "load_s": load_s, "loaded": loaded, "missed": missed,
        "page_cache_dropped": cold, "store_durable_gib_s": total / durable_s / GIB,
    }
    print(f"  {name:14s} store {result['store_gib_s']:6.2f} GiB/s   load {result['load_gib_s']:6.2f} GiB/s"
          f"   ({loaded} chunks loaded and verified, {missed} missed)", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--working-set", type=parse_size, default=1 << 30)
    parser.add_argument("--primary", type=parse_size, default=256 << 20, help="vLLM's CPU tier (cpu_bytes_to_use)")
    parser.add_argument("--chunk", type=parse_size, default=2 << 20)
    parser.add_argument("--store-batch", type=int, default=32, help="chunks per request when storing")
    parser.add_argument("--load-batch", type=int, default=64, help="chunks per request when loading")
    parser.add_argument("--step-ms", type=float, default=1.0, help="pause between scheduler steps")
    parser.add_argument("--dir", type=Path, default=None, help="where both fs tiers write (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    global STEP_S
    STEP_S = args.step_ms / 1000
    logging.basicConfig(level=logging.WARNING)
    register()

    n = args.working_set // args.chunk
    keys = keys_for(n)
    root = Path(tempfile.mkdtemp(prefix="vllm-tier-bench-", dir=args.dir))
    print(f"working set {n} x {args.chunk / MIB:.0f} MiB = {n * args.chunk / GIB:.2f} GiB; vLLM CPU tier "
          f"{args.primary / MIB:.0f} MiB; disk: {root}", flush=True)
    results = {}
    try:
        results["fs"] = run_case("fs", {"type": "fs", "root_dir": str(root / "vllm-fs")}, args, keys)
        shutil.rmtree(root / "vllm-fs", ignore_errors=True)

        with Daemon(int(args.working_set * 1.25) + (64 << 20), log_level="warning") as daemon:
            results["kvstored_ram"] = run_case(
                "kvstored RAM", {"type": "kvstored", "socket": str(daemon.socket)}, args, keys)

        # Cold: the daemon writes everything through to its fs tier, restarts (its RAM empty),
        # the page cache is dropped, and the load has to come from the daemon's disk.
        fs_args = ["--tiers", f"kind=fs,root={root / 'kvstored-fs'},bytes={2 * args.working_set},"
                   f"max_backlog={2 * len(keys)}", "--write-policy", "write-through"]
        ram = int(args.working_set * 1.25) + (64 << 20)
        daemons = [Daemon(ram, log_level="warning", extra_args=fs_args)]
        daemons[0].start()
        tier = {"type": "kvstored", "socket": str(daemons[0].socket)}

        def restart() -> float:
            t = time.perf_counter()
            wait_written_down(daemons[-1], len(keys))
            written_s = time.perf_counter() - t
            daemons[-1].stop()
            daemons.append(Daemon(ram, log_level="warning", extra_args=fs_args))
            daemons[-1].start()
            tier["socket"] = str(daemons[-1].socket)
            return written_s

        try:
            results["kvstored_cold"] = run_case("kvstored cold", tier, args, keys, between=restart)
        finally:
            for daemon in daemons:
                daemon.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    fs = results["fs"]
    rows = []
    for key, label, target in (("kvstored_ram", "kvstored (RAM)", 3.0), ("kvstored_cold", "kvstored (cold fs)", 1.0)):
        r = results[key]
        for op in ("store", "load"):
            rows.append(Row(f"{label} {op}", r[f"{op}_gib_s"], "GiB/s", f"vLLM fs {op}", fs[f"{op}_gib_s"],
                            target=target,
                            note="" if r["missed"] == 0 or op == "store" else f"{r['missed']} chunks missed"))
    cold = results["kvstored_cold"]
    rows.append(Row("kvstored (cold fs) store, until on its disk", cold["store_durable_gib_s"], "GiB/s",
                    "vLLM fs store", fs["store_gib_s"],
                    note="the cascade completes when the chunk is in the daemon's RAM (the row above); "
                         "write-through to its disk continues behind it"))
    print()
    print_table(rows, title="vLLM TieringOffloadingManager, secondary tier throughput (same run, same disk)")
    if not all(r["page_cache_dropped"] for r in results.values()):
        print("  note: could not drop the page cache (not root): loads may be served from it")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "results": results, "rows": [r.to_json() for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
