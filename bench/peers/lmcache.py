# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""LMCache's multiprocess (MP) server (PyPI lmcache 0.5.x, torch's CPU build), driven as `lmcache bench server
--mode cpu` drives it: its ServerBenchClient registers a paged KV cache (ZMQ on loopback, bytes through the
server's L1 in shared memory), then per request LOOKUP + wait for the prefetch, RETRIEVE or STORE, END_SESSION.
A chunk is 256 tokens = 16 blocks of 16 tokens x 2 layers x (K, V) x 8 heads x 128 x fp16 = 2 MiB: slot i is
blocks 16i..16i+15. Key (tag, i) is chunk i of one token sequence per tag (prefix hashes). A LOOKUP read-locks
its hits until the RETRIEVE (or free_lookup_locks)."""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.peers.worker import Driver, Server

VERSION = "0.5.6"
TOKENS = 256  # per chunk (the server's --chunk-size)
BLOCK = 16  # tokens per paged block
HELLO = 9906  # the token lmcache's bench fills requests with
ENV = {"LMCACHE_DISABLE_BANNER": "1"}
# torch (the project's pin, CPU build), lmcache without its CUDA dependencies, what it imports on CPU
STEPS = [
    ["torch==2.13.0", "numpy<=2.2.6"],
    ["--no-deps", f"lmcache=={VERSION}"],
    "aiohttp aiofile aiofiles msgspec pyzmq prometheus_client<=0.24.1 psutil py-cpuinfo pyyaml sortedcontainers "
    "cachetools blake3 fastapi uvicorn httptools httpx requests cryptography protobuf<7,>=6.31.1 "
    "opentelemetry-api<=1.40.0,>=1.20.0 opentelemetry-sdk>=1.20.0 "
    "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0 "
    "safetensors redis numba numpy<=2.2.6".split(),
]
CHECK = (
    "from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient; "
    "import lmcache.v1.multiprocess.server"
)


def start(workdir: Path, capacity: int) -> Server:
    from bench.lib.daemons import free_port, spawn_logged, stop_process
    from bench.peers import venv

    python = venv.ensure("lmcache", STEPS, CHECK)
    port, http = free_port(), free_port()
    shm = f"kvstored-bench-lmcache-{os.getpid()}"  # its L1 in shared memory: engine-driven copies over SHM
    log_path = Path(tempfile.mkstemp(prefix="lmcache-server-", suffix=".log", dir=workdir)[1])
    argv = [
        str(python.parent / "lmcache"),
        "server",
        *f"--host 127.0.0.1 --port {port} --http-host 127.0.0.1 --http-port {http}".split(),
        *f"--l1-size-gb {2 * capacity / (1 << 30):.3f} --eviction-policy LRU --chunk-size {TOKENS}".split(),
        *f"--supported-transfer-mode auto --shm-name {shm} --disable-observability --disable-metrics".split(),
    ]
    proc = spawn_logged(argv, log_path, {**os.environ, **ENV})

    def stop() -> None:
        stop_process(proc, 15, group=True)
        log_path.unlink(missing_ok=True)
        Path("/dev/shm", shm).unlink(missing_ok=True)

    deadline = time.monotonic() + 120
    while b"Uvicorn running" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-400:]
            stop()
            raise RuntimeError(f"lmcache server did not start: {tail}")
        time.sleep(0.2)

    def pids() -> list[int]:
        # the server and whatever it started (its workers), for CPU accounting
        out = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()] or [proc.pid]

    return Server(
        pids=pids,
        config={"rpc_url": f"tcp://127.0.0.1:{port}", "http_url": f"http://127.0.0.1:{http}"},
        describe=f"lmcache {VERSION} MP server (torch CPU), L1 {2 * capacity >> 20} MiB LRU, "
        f"chunk {TOKENS} tokens, ZMQ + SHM",
        stop=stop,
        python=python,
        env=ENV,
    )


class LMCacheDriver(Driver):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        from lmcache.cli.commands.bench.server_bench import helpers
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        heads, rem = divmod(self.chunk, TOKENS * 2 * 2 * 128 * 2)
        if rem or heads == 0:
            raise RuntimeError(f"chunk of {self.chunk} bytes is not 256 tokens of 2 layers of fp16 K/V x 128")
        blocks = self.slots * TOKENS // BLOCK
        config = BenchConfig(
            rpc_url=cfg["rpc_url"],
            http_url=cfg["http_url"],
            mode="cpu",
            transfer_mode="auto",
            tp_size=1,
            use_mla=False,
            num_tokens=TOKENS,
            kvcache_shape_spec=f"({2},{blocks},{BLOCK},{heads},128):float16:2",
            num_blocks=blocks,
            block_size=BLOCK,
        )
        self.h = helpers
        # one registration per client process: the bench's client numbers them from a constant
        helpers._INSTANCE_ID_BASE = 1000 + os.getpid()
        self.bench = ServerBenchClient(config, log=lambda _msg: None)
        self.bench.start()
        self.worker = self.bench._workers[0]
        self.rc = self.bench._req_client
        self.tensors = list(self.worker.kv_caches.values())
        self.arrays = [t.numpy().view(np.uint8).reshape(2, blocks, -1) for t in self.tensors]
        self.ids = itertools.count()
        self.per_chunk = TOKENS // BLOCK
        self._pending: tuple[Any, str] | None = None  # a timed lookup's key and session, freed by release()

    def _tokens(self, tag: str, chunks: int) -> tuple[int, ...]:
        head = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=4).digest(), "big") % (1 << 31)
        return (head,) + (HELLO,) * (chunks * TOKENS)

    def _key(self, tokens: tuple[int, ...], first: int, n: int, rid: str) -> Any:
        return self.h._make_key(tokens, rid, start=first * TOKENS, end=(first + n) * TOKENS, worker_id=0, world_size=1)

    def _blocks(self, n: int) -> list[list[int]]:
        return [list(range(n * self.per_chunk))]

    def _rid(self) -> str:
        return f"bench-{os.getpid()}-{next(self.ids)}"

    def chunk_views(self, slot: int) -> list[np.ndarray]:
        b = slice(slot * self.per_chunk, (slot + 1) * self.per_chunk)
        return [a[kv, b].reshape(-1) for a in self.arrays for kv in (0, 1)]

    def _wait(self, future: Any, what: str) -> Any:
        reply = self.h._wait_for_result(future)
        if reply is self.h._TIMEOUT:
            raise RuntimeError(f"lmcache {what}: timed out")
        return reply

    def store(self, tag: str, n: int, first: int = 0) -> None:
        rid = self._rid()
        tc = self.worker.transfer_context
        key = self._key(self._tokens(tag, first + n), first, n, rid)
        event = tc.create_recorded_event()
        ok = self._wait(
            tc.submit_store(rid, key, self.worker.kv_caches, self._blocks(n), event, self.per_chunk), "STORE"
        )
        self.h._send_end_session(self.rc, rid)
        if not ok:
            raise RuntimeError(f"lmcache STORE of {n} chunks failed")

    def _lookup(self, tokens: tuple[int, ...], n: int, rid: str) -> tuple[Any, int]:
        key = self._key(tokens, 0, n, rid)
        self._wait(self.rc.lookup(key, 1), "LOOKUP")
        hits = self._wait(self.rc.wait_prefetch_status(rid, 10.0), "QUERY_PREFETCH_STATUS")
        return key, int(hits or 0)

    def load(self, tag: str, n: int) -> None:
        rid = self._rid()
        tc = self.worker.transfer_context
        key, hits = self._lookup(self._tokens(tag, n), n, rid)
        if hits != n:
            self._wait(self.rc.free_lookup_locks(key, 1), "FREE_LOOKUP_LOCKS")
            self.h._send_end_session(self.rc, rid)
            raise RuntimeError(f"lmcache LOOKUP found {hits} of {n} chunks")
        blocks, event = self._blocks(n), tc.create_recorded_event()
        future = tc.submit_retrieve(
            rid, key, self.worker.kv_caches, blocks, event, self.per_chunk, skip_first_n_tokens=0
        )
        ok = self._wait(future, "RETRIEVE")
        self.h._send_end_session(self.rc, rid)
        if not ok:
            raise RuntimeError(f"lmcache RETRIEVE of {n} chunks failed")

    def lookup(self, tag: str, n: int) -> int:
        """LOOKUP + the wait for its prefetch (what a scheduler waits for); the read locks it took
        are freed by release(), outside the timing."""
        rid = self._rid()
        key, hits = self._lookup(self._tokens(tag, n), n, rid)
        self._pending = (key, rid)
        return hits

    def release(self) -> None:
        if self._pending is not None:
            key, rid = self._pending
            self._pending = None
            self._wait(self.rc.free_lookup_locks(key, 1), "FREE_LOOKUP_LOCKS")
            self.h._send_end_session(self.rc, rid)

    def remove(self, tag: str, n: int) -> None:
        self.release()  # LMCache evicts by LRU; there is no remove in the MP protocol

    def clear(self) -> None:
        """From an empty L1: its LRU evicted chunks of a lookup set stored just before (found 128 of 256)."""
        self.release()
        self._wait(self.rc.clear(True), "CLEAR")

    def close(self) -> None:
        self.release()
        self.bench.close()
