# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Where the daemon's socket lives unless told otherwise (shared by daemon and client)."""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_SOCKET = Path("/run/kvstored/kvstored.sock")


def default_socket_path(for_daemon: bool = False) -> Path:
    """$KVSTORED_SOCKET, else the systemd unit's path for root (and, for clients, whenever that
    daemon runs and is reachable), else a per-user runtime dir."""
    if os.environ.get("KVSTORED_SOCKET"):
        return Path(os.environ["KVSTORED_SOCKET"])
    if os.geteuid() == 0 or (not for_daemon and _exists(SYSTEM_SOCKET)):
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvstored-{os.geteuid()}"
    return Path(runtime) / "kvstored" / "kvstored.sock"


def session_socket_path(socket: Path | str) -> Path:
    return Path(f"{socket}.session")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. /run/kvstored is 0750 and we are not in its group
        return False
