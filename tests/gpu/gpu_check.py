# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""GPU check of the direct spec's data path (not CI; needs one CUDA GPU; no vLLM needed).

Starts a kvstored daemon, builds CUDA tensors shaped like vLLM's paged KV cache (one
(num_blocks, 2, block_size, kv_heads, head_dim) bf16 tensor per layer), and through the direct
spec's worker copy path (kvstored_client.vllm.pool_worker, which KvstoredOffloadingWorker wraps):
  store  GPU blocks -> daemon pool (Reserve, cudaMemcpyAsync into the pool pinned with
         cudaHostRegister, Commit), then
  load   pool -> other GPU blocks, with leases taken as the scheduler takes them (Acquire),
checks the loaded blocks are byte-equal to the stored ones, and prints GPU->shm and shm->GPU GiB/s
beside a plain cudaMemcpy of the same bytes between GPU memory and pinned host memory.

    tests/gpu/run.sh [--layers 32] [--blocks 1024] [--block-size 16] [--kv-heads 8] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "client")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb  # noqa: E402
from kvstored_client.ops import NamespaceSpec  # noqa: E402
from kvstored_client.vllm.blockcopy import ChunkExtents, KVLayout, LayerRef  # noqa: E402
from kvstored_client.vllm.driver import DaemonLink, outcome  # noqa: E402
from kvstored_client.vllm.pool_worker import PoolTransferEngine  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402

GIB = 1 << 30


def wait_done(engine: PoolTransferEngine, job_id: int, start: float) -> float:
    """Seconds from `start` (just before submitting) until the engine reports the job done."""
    while True:
        for f in engine.get_finished():
            if f.job_id == job_id:
                if not f.success:
                    raise SystemExit(f"job {job_id} failed")
                return time.perf_counter() - start
        if time.perf_counter() - start > 60:
            raise SystemExit(f"job {job_id} did not finish in 60 s")


def acquire(link: DaemonLink, namespace_id: str, keys: list[bytes]) -> tuple[list[int], ChunkExtents]:
    """What the direct spec's scheduler does on lookup: lease the chunks, get their extents."""
    future = link.call("Acquire", pb.AcquireRequest(session_id=link.session_id, namespace_id=namespace_id, keys=keys))
    result = outcome(future)
    if not result.ok or len(result.response.leases) != len(keys):
        raise SystemExit(
            f"Acquire returned {0 if not result.ok else len(result.response.leases)} of {len(keys)} "
            f"leases ({result.error})"
        )
    leases = result.response.leases
    return [lease.handle for lease in leases], ChunkExtents.from_lists(
        [[(e.offset, e.length) for e in lease.extents] for lease in leases]
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def pinned_memcpy_gib_s(nbytes: int, reps: int, device: str) -> tuple[float, float]:
    """Plain cudaMemcpy of nbytes between a GPU buffer and pinned host memory, both directions."""
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    out = []
    for src, dst in ((gpu, host), (host, gpu)):
        times = []
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - t)
        out.append(nbytes / min(times) / GIB)
    del gpu, host
    return out[0], out[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1024, help="blocks moved per transfer")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--blocks-per-chunk", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the same path on CPU tensors")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu for a dry run)")
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name() if device == 'cuda' else 'CPU dry run'}", flush=True
    )

    num_blocks = 2 * args.blocks  # sources in the first half, load destinations in the second
    shape = (num_blocks, 2, args.block_size, args.kv_heads, args.head_dim)
    layers = [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
    page = layers[0][0].numel() * layers[0].element_size()
    layout = KVLayout(layers, [[LayerRef(i, page) for i in range(args.layers)]], args.blocks_per_chunk)
    n_chunks = args.blocks // args.blocks_per_chunk
    moved = n_chunks * layout.part_bytes
    pool_bytes = (args.reps + 1) * moved + GIB
    print(
        f"KV cache: {args.layers} layers x {num_blocks} blocks x {page // 1024} KiB; a transfer moves "
        f"{args.blocks} blocks = {n_chunks} chunks of {layout.part_bytes / (1 << 20):.0f} MiB = "
        f"{moved / GIB:.2f} GiB; "
        f"daemon pool {pool_bytes / GIB:.1f} GiB",
        flush=True,
    )

    base_gpu_to_host, base_host_to_gpu = pinned_memcpy_gib_s(moved, args.reps, device)

    daemon = Daemon(cpu_bytes=str(pool_bytes), page_bytes="2MiB")
    daemon.start(timeout=120)
    ok = True
    try:
        t = time.perf_counter()
        engine = PoolTransferEngine(layout, str(daemon.socket), "gpu-check-worker", connect_timeout_s=30)
        pool = engine.pools[engine.link.pool_id]
        print(
            f"worker session + pool mapped in {time.perf_counter() - t:.1f} s, pinned with cudaHostRegister: "
            f"{bool(pool.pinned)}",
            flush=True,
        )
        scheduler = DaemonLink(daemon.socket, "gpu-check-scheduler")
        spec = NamespaceSpec(
            model="gpu-check", dtype="bfloat16", chunk_bytes=layout.part_bytes, layout="gpu-check", key_bytes=36
        )
        ns = engine.link.namespace(spec)
        assert scheduler.namespace(spec) == ns
        scheduler.settle(30, (ns,))

        results = {}
        for label, order in (("contiguous blocks", "sorted"), ("scattered blocks", "shuffled")):
            store_t, load_t = [], []
            for rep in range(args.reps):

                def blocks(order=order):
                    return torch.randperm(args.blocks).numpy() if order == "shuffled" else np.arange(args.blocks)

                src, dst = blocks(), args.blocks + blocks()
                keys = [hashlib.sha256(f"{label}/{rep}/{c}".encode()).digest() + bytes(4) for c in range(n_chunks)]
                job = hash((label, rep)) & 0xFFFFFF
                t0 = time.perf_counter()
                engine.submit_store(job, src, [args.blocks], [0], ns, keys)
                store_t.append(wait_done(engine, job, t0))
                while engine.has_pending_work():  # Commit
                    engine.poll()
                handles, extents = acquire(scheduler, ns, keys)
                for t_ in layers:
                    t_[args.blocks :].zero_()
                sync(device)
                t0 = time.perf_counter()
                engine.submit_load(job + 1, dst, [args.blocks], [0], [scheduler.pool_id] * n_chunks, extents)
                load_t.append(wait_done(engine, job + 1, t0))
                sync(device)
                src_t = torch.as_tensor(src, device=device)
                dst_t = torch.as_tensor(dst, device=device)
                equal = all(torch.equal(t_[src_t], t_[dst_t]) for t_ in layers)
                ok &= equal
                outcome(scheduler.call("Release", pb.ReleaseRequest(session_id=scheduler.session_id, handles=handles)))
                if not equal:
                    print(f"  {label} rep {rep}: loaded blocks differ from the stored ones", flush=True)
            copies = layout.copies(src, [args.blocks], [0], extents, pool.address, to_pool=True)
            results[label] = (
                moved / min(store_t) / GIB,
                moved / min(load_t) / GIB,
                len(copies),
                statistics.median(store_t),
                statistics.median(load_t),
            )
        engine.close()
        scheduler.close()
    finally:
        daemon.stop()

    print()
    print(f"{'path':40s} {'GPU->shm':>10s} {'shm->GPU':>10s} {'copies':>8s}")
    print(f"{'cudaMemcpy, pinned host memory':40s} {base_gpu_to_host:8.2f} GiB/s {base_host_to_gpu:8.2f} GiB/s {1:8d}")
    for label, (store, load, n_copies, _, _) in results.items():
        print(
            f"{'direct spec worker, ' + label:40s} {store:8.2f} GiB/s {load:8.2f} GiB/s {n_copies:8d}"
            f"   ({store / base_gpu_to_host:.2f}x / {load / base_host_to_gpu:.2f}x of cudaMemcpy)"
        )
    print(
        "  (store: Reserve + copies + done, Commit after; load: copies only, leases taken beforehand; best of "
        f"{args.reps})"
    )
    print("byte equality:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
