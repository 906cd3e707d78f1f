"""Where the daemon's socket lives unless told otherwise (shared by daemon and client)."""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_SOCKET = Path("/run/kvstored/kvstored.sock")


def default_socket_path() -> Path:
    """$KVSTORED_SOCKET, else the systemd unit's path (for root, or when that daemon runs), else
    a per-user runtime dir."""
    if os.environ.get("KVSTORED_SOCKET"):
        return Path(os.environ["KVSTORED_SOCKET"])
    if os.geteuid() == 0 or SYSTEM_SOCKET.exists():
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvstored-{os.geteuid()}"
    return Path(runtime) / "kvstored" / "kvstored.sock"


def session_socket_path(socket: Path | str) -> Path:
    return Path(f"{socket}.session")
