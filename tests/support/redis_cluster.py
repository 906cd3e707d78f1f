# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A real Redis Cluster on loopback for the fleet directory's tests: 3 masters and 3 replicas
(Debian's redis-server 7 in cluster mode, `redis-cli --cluster create`), each on a free port.

    with RedisCluster() as rc:
        rc.url                      # redis://127.0.0.1:P1,127.0.0.1:P2,... for `directory =`
        rc.kill_master(0)           # SIGKILL a master, until its replica is promoted
        rc.freeze(port); rc.thaw(port)
        rc.stop_all(); rc.start_all()   # the cluster unreachable, then back (same ports, same data dirs)
        rc.admin(port)              # redis-py on one node as the admin user (binary keys, resharding)
        rc.begin_migration(slot, src, dst); rc.migrate(slot, src, dst, keys); rc.end_migration(slot, dst)

cluster-node-timeout is short (1 s) so a failover takes a few seconds, not fifteen.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.daemon import short_tmpdir
from tests.support.needs import Needs, require
from tests.support.ports import free_port
from tests.support.tls import make_certs

WAIT_S = 60.0  # a bound for every wait on the cluster's state, never a measurement
NODE_TIMEOUT_MS = 1000


class RedisClusterError(AssertionError):
    pass


@dataclass
class RedisNode:
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (so at most 55535)."""
    for _ in range(1000):
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RedisClusterError("no free port pair (PORT, PORT + 10000) for a cluster node")


Wrap = Callable[[Sequence[str]], list[str]]


def _cli(port: int, *args: str, timeout: float = 10.0, client: tuple[str, ...] = (), wrap: Wrap = list) -> str:
    done = subprocess.run(
        wrap(["redis-cli", *client, "-h", "127.0.0.1", "-p", str(port), *args]),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout


class RedisCluster:
    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        tls: bool = False,
        password: str = "",
        acl: str = "~kvd:* +@all",
        host: str = "127.0.0.1",
        wrap: Wrap = list,
    ) -> None:
        """tls: TLS only (clients, the cluster bus, replication), certificates for 127.0.0.1 from
        tests/support/tls.py (`ca`: their CA); password: a user `kvstored` with it and the ACL rules
        `acl` (by default: the directory's keys only, `kvd:*`), a user `admin` with it and every
        right (replication, cluster set-up, this harness's own commands), the default user off.
        host and wrap: the nodes listen on `host` too and run as `wrap(argv)` (a network
        namespace's Node.exec: reached at its IP)."""
        require(Needs.SYSTEM_DEPS)  # (redis-server comes with deploy/install-system-deps.sh)
        if shutil.which("redis-server") is None:
            raise RedisClusterError("redis-server is not installed (deploy/install-system-deps.sh redis-server)")
        self.workdir = short_tmpdir("kvrc")
        self.masters = masters
        self.nodes = [RedisNode(_cluster_port(), self.workdir / f"r{i}") for i in range(masters * (1 + replicas))]
        self.replicas = replicas
        self.tls = tls
        self.password = password
        self.host = host
        self._wrap = wrap
        self.ca: Path | None = None
        self._server_args: list[str] = []
        client: list[str] = []
        if tls:
            certs = make_certs(self.workdir)
            self.ca = certs.ca
            self._server_args += [
                "--tls-cluster", "yes", "--tls-replication", "yes", "--tls-auth-clients", "no",
                "--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
                "--tls-ca-cert-file", str(certs.ca),
            ]  # fmt: skip
            client += ["--tls", "--cacert", str(certs.ca)]
        if password:
            self._server_args += [
                "--user", "default", "off",
                "--user", "admin", "on", f">{password}", "~*", "&*", "+@all",
                "--user", "kvstored", "on", f">{password}", *acl.split(),
                "--masteruser", "admin", "--masterauth", password,
            ]  # fmt: skip
            client += ["--user", "admin", "--pass", password, "--no-auth-warning"]
        self._client = tuple(client)

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> RedisCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.workdir.mkdir()
            self._run(node)
        for node in self.nodes:
            self._wait_answers(node)
        out = subprocess.run(
            self._wrap(
                [
                    "redis-cli",
                    *self._client,
                    "--cluster",
                    "create",
                    *(f"{self.host}:{n.port}" for n in self.nodes),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ]
            ),
            capture_output=True,
            text=True,
            timeout=2 * WAIT_S,  # redis-cli waits for every node to agree: slow on a loaded box
            check=False,
        )
        if out.returncode != 0:
            raise RedisClusterError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        self.wait_ok()
        return self

    def _run(self, node: RedisNode) -> None:
        node.proc = subprocess.Popen(
            self._wrap(
                [
                    "redis-server",
                    *(["--port", "0", "--tls-port", str(node.port)] if self.tls else ["--port", str(node.port)]),
                    *self._server_args,
                    "--bind",
                    " ".join(dict.fromkeys([self.host, "127.0.0.1"])),
                    *(["--protected-mode", "no"] if self.host != "127.0.0.1" else []),  # (a private namespace)
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(NODE_TIMEOUT_MS),
                    "--repl-diskless-sync-delay",
                    "0",
                    "--cluster-replica-validity-factor",
                    "0",  # a replica takes over however long it was cut off
                    "--appendonly",
                    "no",
                    "--save",
                    "",
                    "--dir",
                    str(node.workdir),
                    "--logfile",
                    "redis.log",
                    "--daemonize",
                    "no",
                ]
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _wait_answers(self, node: RedisNode) -> None:
        def answers() -> bool:
            if not node.running:
                raise RedisClusterError(f"redis {node.port} exited: see {node.workdir / 'redis.log'}")
            return self._cli(node.port, "ping").strip() == "PONG"

        self._wait(f"redis {node.port} answers PING", answers)

    def close(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
                node.proc.kill()
                node.proc.wait(timeout=10)
        if not os.environ.get("KEEP_REDIS"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- what the daemons are told ------------------------------------------------------------

    @property
    def url(self) -> str:
        auth = f"kvstored:{self.password}@" if self.password else ""
        return ("rediss://" if self.tls else "redis://") + auth + ",".join(f"{self.host}:{n.port}" for n in self.nodes)

    def cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        """redis-cli's output of one command to the node on `port`."""
        return self._cli(port, *args, timeout=timeout)

    def _cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        return _cli(port, *args, timeout=timeout, client=self._client, wrap=self._wrap)

    # -- its state ----------------------------------------------------------------------------

    def info(self, port: int) -> dict[str, str]:
        out = {}
        for line in self._cli(port, "cluster", "info", timeout=2).splitlines():
            key, sep, value = line.strip().partition(":")
            if sep:
                out[key] = value
        return out

    def master_ports(self) -> list[int]:
        """The ports of the masters serving slots now, as a running node sees them."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                text = self._cli(node.port, "cluster", "nodes", timeout=2)
            except subprocess.TimeoutExpired:
                continue  # (frozen)
            ports = []
            for line in text.splitlines():
                parts = line.split()
                if len(parts) >= 9 and "master" in parts[2] and "fail" not in parts[2]:
                    ports.append(int(parts[1].split("@")[0].rpartition(":")[2]))
            if ports:
                return sorted(ports)
        return []

    def replica_of(self, master_port: int) -> int:
        for node in self.nodes:
            if node.running and node.port != master_port:
                role = self._cli(node.port, "role", timeout=2).split()
                if role and role[0] == "slave" and int(role[2]) == master_port:
                    return node.port
        raise RedisClusterError(f"no replica of {master_port}")

    def node(self, port: int) -> RedisNode:
        return next(n for n in self.nodes if n.port == port)

    def wait_ok(self) -> None:
        """Until every running, unfrozen node says cluster_state:ok and every slot is served."""

        def ok() -> bool:
            running = [n for n in self.nodes if n.running]
            try:
                infos = [self.info(n.port) for n in running]
            except subprocess.TimeoutExpired:
                return False
            if not infos or not all(
                i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos
            ):
                return False
            # replicas in sync with their masters: only a synced replica can take over
            for n in running:
                fields = dict(
                    line.strip().partition(":")[::2]
                    for line in self._cli(n.port, "info", "replication", timeout=2).splitlines()
                )
                if fields.get("role") == "slave" and fields.get("master_link_status") != "up":
                    return False
            return True

        self._wait("cluster_state:ok on every node", ok)

    # -- resharding (through redis-py: keys are binary, and redis-py is another client than the
    # daemon's own, so it checks that client rather than mirroring it) ---------------------------

    def admin(self, port: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10, **self._redis_py_options())

    def _redis_py_options(self) -> dict[str, Any]:
        auth = {"username": "admin", "password": self.password} if self.password else {}
        return auth | ({"ssl": True, "ssl_ca_certs": str(self.ca)} if self.tls else {})

    def cluster_client(self):
        """redis-py's cluster client as the admin user: to check what another client wrote."""
        from redis.cluster import ClusterNode
        from redis.cluster import RedisCluster as Client

        node = next(n for n in self.nodes if n.running)
        return Client(
            startup_nodes=[ClusterNode("127.0.0.1", node.port)], socket_timeout=10, **self._redis_py_options()
        )

    def node_id(self, port: int) -> str:
        with self.admin(port) as r:
            return r.execute_command("CLUSTER", "MYID").decode()

    def slot_owner(self, slot: int) -> int:
        """The port of the master serving slot, as the first running node sees it."""
        node = next(n for n in self.nodes if n.running)
        with self.admin(node.port) as r:
            for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise RedisClusterError(f"no master serves slot {slot}")

    def begin_migration(self, slot: int, src: int, dst: int) -> None:
        """Slot `slot` importing on dst, migrating on src (keys moved by migrate())."""
        with self.admin(dst) as r:
            r.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(src))
        with self.admin(src) as r:
            r.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(dst))

    def migrate(self, slot: int, src: int, dst: int, keys: Sequence[bytes] | None = None) -> int:
        """MIGRATE keys (default: every key left in the slot on src) from src to dst; how many."""
        with self.admin(src) as r:
            if keys is None:
                keys = r.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000)
            if keys:
                auth = ["AUTH2", "admin", self.password] if self.password else []
                r.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 10_000, *auth, "KEYS", *keys)
        return len(keys or ())

    def end_migration(self, slot: int, dst: int) -> None:
        """The slot is dst's, told to dst first, then to every other master (as redis-cli does)."""
        dst_id = self.node_id(dst)
        for port in [dst] + [p for p in self.master_ports() if p != dst]:
            with self.admin(port) as r:
                r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    # -- faults -------------------------------------------------------------------------------

    def kill_master(self, index: int = 0) -> tuple[int, int]:
        """SIGKILL the index-th master; returns (its port, the replica promoted in its place),
        once the replica is a master and the cluster is ok again."""
        master = self.master_ports()[index]
        replica = self.replica_of(master)
        proc = self.node(master).proc
        assert proc is not None
        proc.kill()
        proc.wait(timeout=10)
        self._wait(
            f"replica {replica} promoted in place of {master}",
            lambda: self._cli(replica, "role", timeout=2).split()[:1] == ["master"],
        )
        self.wait_ok()
        return master, replica

    def freeze(self, port: int) -> None:
        proc = self.node(port).proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)

    def thaw(self, port: int) -> None:
        proc = self.node(port).proc
        assert proc is not None
        proc.send_signal(signal.SIGCONT)

    def stop_all(self) -> None:
        """Every node down (SIGTERM, then waited for): the directory unreachable."""
        for node in self.nodes:
            if node.running:
                assert node.proc is not None
                node.proc.send_signal(signal.SIGCONT)
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                node.proc.wait(timeout=30)

    def start_all(self) -> None:
        """Every node up again on its port, from its nodes.conf: the same cluster (empty)."""
        for node in self.nodes:
            if not node.running:
                self._run(node)
        for node in self.nodes:
            self._wait_answers(node)
        self.wait_ok()

    def _wait(self, what: str, check, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                pass
            if time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {n.port}: {(n.workdir / 'redis.log').read_text()[-1500:]}"
                    for n in self.nodes
                    if (n.workdir / "redis.log").exists()
                )
                raise RedisClusterError(f"never {what} within {timeout:.0f} s\n{logs}")
            time.sleep(0.1)
