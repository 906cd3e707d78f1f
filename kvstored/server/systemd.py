# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""sd_notify without libsystemd: datagrams to $NOTIFY_SOCKET, a no-op outside systemd.

The fd store (systemd 254+, `FileDescriptorStoreMax=` in the unit, announced to the service as
$FDSTORE): `FDSTORE=1` with `FDNAME=` sends an fd along (SCM_RIGHTS) for systemd to keep while
the service restarts; the next start gets them back as LISTEN_FDS / LISTEN_FDNAMES (from fd 3),
with LISTEN_PID naming it. kvstored keeps its RAM tier there (kvstored/server/handover.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket

from kvstored.server.handover import ARENA_FD, POOL_FD, STATE_FD, HandedOver

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3


def _address() -> str | None:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return None
    return "\0" + address[1:] if address.startswith("@") else address  # "@": abstract namespace


def notify(state: str, fds: list[int] | None = None) -> bool:
    address = _address()
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            if fds:
                socket.send_fds(sock, [state.encode()], fds)
            else:
                sock.sendall(state.encode())
        return True
    except OSError as exc:
        log.warning("sd_notify %r failed: %s", state.splitlines()[0], exc)
        return False


def fd_store_enabled() -> bool:
    """Running under systemd with a fd store (FileDescriptorStoreMax= > 0)."""
    try:
        return _address() is not None and int(os.environ.get("FDSTORE", "0")) > 0
    except ValueError:
        return False


def store_fds(fds: dict[str, int]) -> None:
    """Put each fd into systemd's fd store under its name, the state last: a store holding a state
    holds everything it names. OSError if systemd does not take one."""
    for name in sorted(fds, key=lambda n: n == STATE_FD):
        if not notify(f"FDSTORE=1\nFDNAME={name}", [fds[name]]):
            raise OSError(f"systemd's fd store did not take {name}")


def forget_fds(names: list[str]) -> None:
    """Take fds out of systemd's fd store (once adopted, a stored state describes RAM no more)."""
    for name in names:
        notify(f"FDSTOREREMOVE=1\nFDNAME={name}")


def listened_fds() -> HandedOver | None:
    """kvstored's fds that systemd passed to this process (LISTEN_FDS), or None. The variables
    are removed, so no child takes them for its own; other fds passed are left alone."""
    pid, count, names = (os.environ.pop(k, "") for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"))
    if not count or pid != str(os.getpid()):
        return None
    try:
        n = int(count)
    except ValueError:
        return None
    labels = names.split(":") if names else []
    ours: dict[str, int] = {}
    for i in range(n):
        fd, name = LISTEN_FDS_START + i, labels[i] if i < len(labels) else ""
        if name in (STATE_FD, POOL_FD) or name.startswith(ARENA_FD):
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
            ours[name] = fd
    if not ours:
        return None
    return HandedOver(ours, "systemd's fd store")
