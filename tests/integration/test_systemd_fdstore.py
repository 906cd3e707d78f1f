# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A real systemd keeps the RAM tier across `systemctl restart`: the daemon stores its pool in the
service's fd store at stop and adopts it from LISTEN_FDS at the next start.

This machine's systemd is not PID 1, so the test starts a user manager (`systemd --user`) of its
own: in cgroups of its own (removed after: a manager in the root cgroup moves every process there
into an init.scope), in a private mount namespace with /run/systemd/system present (without it
`systemd --user` refuses to run on a system not booted with systemd), its runtime directory a
temporary one, talked to with `systemctl --user` over its private socket. The service's output
goes to a file (no journald here)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstored_client import Client, Tier
from tests.support.daemon import REPO_ROOT, kvstored_command, short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

pytestmark = [pytest.mark.root, pytest.mark.system_deps]

SYSTEMD = Path("/usr/lib/systemd/systemd")
CHUNK = 64 << 10
WAIT_S = 60.0  # a hang guard only: every wait ends on a state
# In cgroups of its own: a manager that finds itself in the root cgroup moves every process there
# (the machine's) into an init.scope. /run/systemd/system exists on a system booted with systemd;
# systemd --user insists on it (here in a private mount namespace).
_MANAGER = (
    'for d in {cgroups}; do echo $$ > "$d/cgroup.procs" || exit 3; done; '
    "mkdir -p /run/systemd && mount -t tmpfs kvstored-test /run/systemd && mkdir /run/systemd/system && "
    "exec {systemd} --user"
)


def own_cgroups() -> list[Path]:
    """A new child of this process's cgroup in each hierarchy systemd tracks units in: cgroup2, and
    name=systemd where the machine is hybrid."""
    mine = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
    name = f"kvstored-test-{uuid.uuid4().hex[:8]}"  # one name: a hybrid systemd mirrors its cgroup2 path
    made = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount, fstype, options = line.split()[:4]
        key = "" if fstype == "cgroup2" else "name=systemd" if "name=systemd" in options.split(",") else None
        if key is not None and key in mine:
            made.append(Path(mount) / mine[key].lstrip("/") / name)
            made[-1].mkdir()
    return made


def remove_cgroups(roots: list[Path]) -> None:
    """Each cgroup and what the manager made under it, once their processes are gone."""
    for root in roots:
        for d in [*sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)), root]:
            wait_for(functools.partial(_empty, d), WAIT_S)
            d.rmdir()


def _empty(cgroup: Path) -> bool:
    return not (cgroup / "cgroup.procs").read_text().strip()


class UserManager:
    def __init__(self, runtime: Path) -> None:
        self.runtime = runtime
        self.env = {"PATH": os.environ["PATH"], "XDG_RUNTIME_DIR": str(runtime), "HOME": str(runtime)}

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["systemctl", "--user", *args], env=self.env, capture_output=True, text=True, timeout=WAIT_S
        )
        assert proc.returncode == 0 or not check, f"systemctl {' '.join(args)}: {proc.stderr}{self.log()}"
        return proc

    def run(self, *args: str) -> None:
        proc = subprocess.run(
            ["systemd-run", "--user", *args], env=self.env, capture_output=True, text=True, timeout=WAIT_S
        )
        assert proc.returncode == 0, proc.stderr + self.log()

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.runtime.glob("*.log")))


@pytest.fixture
def manager() -> Iterator[UserManager]:
    assert SYSTEMD.exists() and shutil.which("systemctl") and shutil.which("unshare"), "needs systemd's binaries"
    runtime = short_tmpdir("kvsd")
    os.chmod(runtime, 0o700)
    m = UserManager(runtime)
    cgroups = own_cgroups()
    script = _MANAGER.format(cgroups=" ".join(f"'{d}'" for d in cgroups), systemd=SYSTEMD)
    log = open(runtime / "manager.log", "wb")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env=m.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        # Started: its units are up, among them the D-Bus socket that systemd-run talks through.
        ready = wait_for(
            lambda: (
                proc.poll() is None
                and m.systemctl("show", "-p", "SystemState", check=False).stdout.strip()
                in ("SystemState=running", "SystemState=degraded")
                and (runtime / "bus").is_socket()
            ),
            WAIT_S,
        )
        assert ready, (runtime / "manager.log").read_text()
        yield m
    finally:
        proc.terminate()
        proc.wait(WAIT_S)
        remove_cgroups(cgroups)
        shutil.rmtree(runtime, ignore_errors=True)


def tiers(sock: Path, model: str, keys: list[bytes]) -> list[Tier]:
    """Where each chunk is, checking that each one that loads is byte-exact."""
    with Client(sock, deadline_s=10.0) as kv:
        ns = kv.register_namespace(model=model, dtype="u8", chunk_bytes=CHUNK)
        found = kv.lookup(ns, keys).tiers
        got = np.zeros((len(keys), CHUNK), dtype=np.uint8)
        hits = found.index(Tier.NONE) if Tier.NONE in found else len(found)
        assert kv.load(ns, keys[:hits], got[:hits]) == hits
        assert np.array_equal(got[:hits], payloads(keys[:hits], CHUNK)), "a wrong byte was served"
    return found


def pools(pid: int) -> int:
    """How many pool memfds the process has open (distinct ones: it may hold one more than once)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # (closed while listed)
            if os.readlink(fd).startswith("/memfd:kvstored-pool"):
                inodes.add(fd.stat().st_ino)
    return len(inodes)


def test_systemctl_restart_keeps_every_chunk_a_byte_exact_ram_hit(manager, ns_name):
    unit = f"kvstored-test-{uuid.uuid4().hex[:8]}"
    sock, log = manager.runtime / "kv.sock", manager.runtime / "kvstored.log"
    manager.run(
        f"--unit={unit}",
        "-p",
        "Type=notify",
        "-p",
        "NotifyAccess=main",
        "-p",
        "FileDescriptorStoreMax=16",
        "-p",
        f"WorkingDirectory={REPO_ROOT}",
        "-p",
        f"StandardOutput=append:{log}",
        "-p",
        f"StandardError=append:{log}",
        # systemd 254+ sets FDSTORE itself from FileDescriptorStoreMax=; this machine's is 252
        "--setenv=FDSTORE=16",
        f"--setenv=PYTHONPATH={REPO_ROOT}{os.pathsep}{REPO_ROOT / 'client'}",  # (this checkout, not an installed one)
        "--",
        *kvstored_command(),
        "serve",
        "--socket",
        str(sock),
        "--cpu-bytes",
        "16MiB",
        "--metrics-addr",
        "off",
    )
    try:
        keys = make_keys("systemd-fdstore", 48)
        with Client(sock, deadline_s=10.0) as kv:
            ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == len(keys)
        assert tiers(sock, ns_name, keys) == [Tier.RAM] * len(keys)

        manager.systemctl("restart", unit)  # returns once the new process said READY=1
        assert tiers(sock, ns_name, keys) == [Tier.RAM] * len(keys), log.read_text()
        text = log.read_text()
        assert "RAM tier handed over by systemd's fd store" in text, text
        assert f"RAM tier adopted: {len(keys)} chunks" in text, text

        # handover = false: the next restart is cold (what systemd kept is not adopted)
        manager.systemctl("set-environment", "KVSTORED_HANDOVER=false")
        manager.systemctl("restart", unit)
        assert tiers(sock, ns_name, keys) == [Tier.NONE] * len(keys)
        assert "the RAM tier kept in systemd's fd store is released" in log.read_text()
        pid = manager.systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip()
        assert pools(int(pid)) == 1, "the pool systemd kept is still open beside the new one"
    finally:
        manager.systemctl("stop", unit, check=False)
