# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The systems that run from the project's own venv: kvstored (a real daemon, the client's default path: the
fast path with the pool mapped), Redis 7 (redis-server, redis-py + hiredis, LMCache's usual remote backend) and
memcpy (the copy every system makes at least once: slots to a private area of the same process and back)."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.peers.worker import Driver, Server

PIPELINE = 16  # Redis commands per pipeline (2 MiB each; deeper pipelines measured slower here)


def _flat_slots(chunk: int, slots: int) -> np.ndarray:
    from bench.lib.buffers import aligned_pool

    return np.frombuffer(aligned_pool(chunk * slots), dtype=np.uint8)  # (the array keeps the mapping)


def start_kvstored(workdir: Path, capacity: int) -> Server:
    from bench.lib.daemons import Daemon

    daemon = Daemon(capacity, extra_args=["--metrics-addr", "off"])
    daemon.start()
    describe = f"kvstored daemon, {capacity >> 20} MiB RAM tier, client default path (fast path)"
    return Server(lambda: [daemon.pid], {"socket": str(daemon.socket)}, describe, daemon.stop)


def _blake2b_key(tag: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest()


class KvstoredDriver(Driver):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        from kvstored_client import Client, NamespaceSpec

        self.buf = _flat_slots(self.chunk, self.slots)
        self.client = Client(cfg["socket"], deadline_s=60.0, client_name="bench-compare")
        self.ns = self.client.register_namespace(
            NamespaceSpec(model="bench/compare", dtype="u8", chunk_bytes=self.chunk)
        )

    def _keys(self, tag: str, n: int, first: int = 0) -> list[bytes]:
        return self.key_list(tag, n, first, _blake2b_key)

    def store(self, tag: str, n: int, first: int = 0) -> None:
        r = self.client.store(self.ns, self._keys(tag, n, first), self.buf[: n * self.chunk])
        if r.stored != n:
            raise RuntimeError(f"kvstored store of {n}: {r}")

    def load(self, tag: str, n: int) -> None:
        got = self.client.load(self.ns, self._keys(tag, n), self.buf[: n * self.chunk])
        if got != n:
            raise RuntimeError(f"kvstored load of {n}: {got} chunks")

    def lookup(self, tag: str, n: int) -> int:
        return int(self.client.lookup(self.ns, self._keys(tag, n)).prefix_hits)

    def remove(self, tag: str, n: int) -> None:
        self.client.delete(self.ns, self._keys(tag, n))

    def close(self) -> None:
        self.client.close()


def start_redis(workdir: Path, capacity: int) -> Server:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not installed (apt-get install -y --no-install-recommends redis-server)")
    from bench.lib.daemons import free_port, spawn_logged, stop_process, wait_listening

    port = free_port()
    rdir = Path(tempfile.mkdtemp(prefix="redis-", dir=workdir))
    argv = f"--bind 127.0.0.1 --port {port} --appendonly no --protected-mode no --daemonize no".split()
    argv += ["--save", "", "--dir", str(rdir), "--maxmemory", str(capacity)]
    proc = spawn_logged([exe, *argv], rdir / "redis.log")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()

    def stop() -> None:
        stop_process(proc, 10)
        shutil.rmtree(rdir, ignore_errors=True)

    try:
        wait_listening(port, proc, rdir / "redis.log", "redis-server", 20)
    except RuntimeError:
        stop()
        raise
    from redis.utils import HIREDIS_AVAILABLE

    describe = f"{version}; redis-py hiredis parser: {HIREDIS_AVAILABLE}; pipelines of {PIPELINE}"
    return Server(lambda: [proc.pid], {"port": port}, describe, stop)


class RedisDriver(Driver):
    """SET/GET pipelined 16 from/into the slots (a GET's bytes object is copied into its slot:
    the copy a consumer makes)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        import redis

        self.buf = _flat_slots(self.chunk, self.slots)
        self.r = redis.Redis(host="127.0.0.1", port=cfg["port"], socket_timeout=60)

    def _key(self, tag: str, i: int) -> bytes:
        return f"{tag}/{i}".encode()

    def _pipelines(self, n: int) -> Iterator[tuple[Any, range]]:
        """(a pipeline, its slots) per PIPELINE slots of 0..n-1."""
        for b in range(0, n, PIPELINE):
            yield self.r.pipeline(transaction=False), range(b, min(b + PIPELINE, n))

    def store(self, tag: str, n: int, first: int = 0) -> None:
        c = self.chunk
        for pipe, slots in self._pipelines(n):
            for s in slots:
                pipe.set(self._key(tag, first + s), self.buf[s * c : (s + 1) * c].data)
            if not all(pipe.execute()):
                raise RuntimeError("redis SET failed")

    def load(self, tag: str, n: int) -> None:
        c = self.chunk
        for pipe, slots in self._pipelines(n):
            for s in slots:
                pipe.get(self._key(tag, s))
            for s, value in zip(slots, pipe.execute()):
                if value is None or len(value) != c:
                    raise RuntimeError(f"redis GET of {tag}/{s}: missing")
                self.buf[s * c : (s + 1) * c] = np.frombuffer(value, dtype=np.uint8)

    def lookup(self, tag: str, n: int) -> int:
        return int(self.r.exists(*[self._key(tag, i) for i in range(n)]))

    def remove(self, tag: str, n: int) -> None:
        self.r.delete(*[self._key(tag, i) for i in range(n)])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.r.close()


def start_memcpy(workdir: Path, capacity: int) -> Server:
    return Server(pids=list, config={}, describe="np.copyto of each 2 MiB piece, slots <-> a private area")


class MemcpyDriver(Driver):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        self.buf = _flat_slots(self.chunk, self.slots)
        self.area = _flat_slots(self.chunk, self.slots)

    def store(self, tag: str, n: int, first: int = 0) -> None:
        c = self.chunk
        for s in range(n):
            np.copyto(self.area[s * c : (s + 1) * c], self.buf[s * c : (s + 1) * c])

    def load(self, tag: str, n: int) -> None:
        c = self.chunk
        for s in range(n):
            np.copyto(self.buf[s * c : (s + 1) * c], self.area[s * c : (s + 1) * c])
