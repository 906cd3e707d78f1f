# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Mooncake Store (PyPI mooncake-transfer-engine-non-cuda, TCP on loopback) in two set-ups. Standalone:
`mooncake_master` (with its HTTP metadata server) + the per-node `mooncake_client` holding the segment; each
client process is a dummy client with slots from `alloc_from_mem_pool` + `register_buffer` (zero copy; a plain
put would ship the value over RPC). Embedded: the master only; each client process mounts its own segment.
Its binaries link libibverbs.so.1 even for TCP. Every get/exists takes a 10 s lease, so removals are forced."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.peers.worker import Driver, Server

PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def _venv() -> Path:
    from bench.peers import venv

    if subprocess.run(["sh", "-c", "ldconfig -p | grep -q 'libibverbs.so.1 '"]).returncode:
        raise RuntimeError("libibverbs.so.1 missing (apt-get install -y --no-install-recommends libibverbs1)")
    return venv.ensure("mooncake", [[PACKAGE, "numpy"]], "import mooncake.store")


def start(workdir: Path, capacity: int, standalone: bool) -> Server:
    from bench.lib.daemons import free_port, spawn_logged, stop_process, wait_listening

    python = _venv()
    bindir = python.parent
    env = {**os.environ, **ENV}
    rundir = Path(tempfile.mkdtemp(prefix="mooncake-", dir=workdir))
    rpc, http, metrics, client_port = free_port(), free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []

    def stop() -> None:
        for p in reversed(procs):
            stop_process(p, 10)
        shutil.rmtree(rundir, ignore_errors=True)

    try:
        master_argv = [
            str(bindir / "mooncake_master"),
            *f"-rpc_port={rpc} -rpc_address=127.0.0.1 -enable_http_metadata_server=true".split(),
            *f"-http_metadata_server_host=127.0.0.1 -http_metadata_server_port={http} -metrics_port={metrics}".split(),
            "-enable_metric_reporting=false",
        ]
        procs.append(spawn_logged(master_argv, rundir / "master.log", env))
        wait_listening(rpc, procs[0], rundir / "master.log", "mooncake_master", 30)
        wait_listening(http, procs[0], rundir / "master.log", "mooncake_master's metadata server", 30)
        config: dict[str, Any] = {"master": f"127.0.0.1:{rpc}", "metadata": f"http://127.0.0.1:{http}/metadata"}
        if standalone:
            client_argv = [
                str(bindir / "mooncake_client"),
                *f"-master_server_address={config['master']} -metadata_server={config['metadata']}".split(),
                *f"-global_segment_size={capacity} -host=127.0.0.1 -port={client_port} -protocol=tcp".split(),
            ]
            procs.append(spawn_logged(client_argv, rundir / "client.log", env))
            wait_listening(client_port, procs[1], rundir / "client.log", "mooncake_client", 30)
            config["client"] = f"127.0.0.1:{client_port}"
        else:
            config["segment"] = capacity
    except BaseException:
        stop()
        raise
    mode = "standalone mooncake_client + dummy clients" if standalone else "embedded clients"
    return Server(
        pids=lambda: [p.pid for p in procs],
        config=config,
        describe=f"{PACKAGE}, TCP on loopback, {mode}, {capacity >> 20} MiB segment(s)",
        stop=stop,
        python=python,
        env=ENV,
    )


class MooncakeDriver(Driver):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        from mooncake.store import MooncakeDistributedStore

        self.store_ = MooncakeDistributedStore()
        self.size = self.chunk * self.slots
        if "client" in cfg:  # standalone: a dummy client, its slots in the per-node client's pool
            if rc := self.store_.setup_dummy(self.size + (64 << 20), 64 << 20, cfg["client"]):
                raise RuntimeError(f"setup_dummy: {rc}")
            self.ptr = int(self.store_.alloc_from_mem_pool(self.size))
            if not self.ptr:
                raise RuntimeError("alloc_from_mem_pool failed")
        else:  # embedded: this process mounts a segment of its own
            from bench.lib.buffers import aligned_pool

            rc = self.store_.setup("127.0.0.1", cfg["metadata"], cfg["segment"], 64 << 20, "tcp", "", cfg["master"])
            if rc:
                raise RuntimeError(f"setup: {rc}")
            self._map = aligned_pool(self.size)
            self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        if rc := self.store_.register_buffer(self.ptr, self.size):
            raise RuntimeError(f"register_buffer: {rc}")
        self.buf = np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(self.ptr))
        self.buf[:] = 0  # populate

    def _keys(self, tag: str, n: int, first: int = 0) -> list[str]:
        return self.key_list(tag, n, first, lambda tag, i: f"{tag}/{i}")

    def store(self, tag: str, n: int, first: int = 0) -> None:
        c = self.chunk
        rcs = self.store_.batch_put_from(self._keys(tag, n, first), [self.ptr + s * c for s in range(n)], [c] * n)
        if any(rcs):
            raise RuntimeError(f"batch_put_from: {sorted(set(rcs))}")

    def load(self, tag: str, n: int) -> None:
        c = self.chunk
        got = self.store_.batch_get_into(self._keys(tag, n), [self.ptr + s * c for s in range(n)], [c] * n)
        if any(g != c for g in got):
            raise RuntimeError(f"batch_get_into: {sorted(set(got))}")

    def lookup(self, tag: str, n: int) -> int:
        return sum(1 for r in self.store_.batch_is_exist(self._keys(tag, n)) if r == 1)

    def remove(self, tag: str, n: int) -> None:
        for key in self._keys(tag, n):
            self.store_.remove(key, True)  # forced: the lookups' leases would hold it for 10 s

    def close(self) -> None:
        self.store_.close()
