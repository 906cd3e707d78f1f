# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Whether a TCP address can be listened on, asked before the daemon populates its RAM tier so
that a taken port costs a second, not a populate. The real listener binds later; a port taken in
between still fails there, with the same message."""

from __future__ import annotations

import socket


def split_host_port(addr: str) -> tuple[str, int]:
    """'127.0.0.1:9464' -> ('127.0.0.1', 9464); '[::1]:9464' -> ('::1', 9464)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def bind_problem(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on now (the OS's words), or None if it can. Port 0
    (any free port) always can. SO_REUSEADDR as servers set it, so a port a stopped daemon left
    in TIME_WAIT is free, and one something listens on is not."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    for family, kind, proto, _, address in infos:
        probe = socket.socket(family, kind, proto)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
            probe.listen(1)
        except OSError as exc:
            return exc.strerror or str(exc)
        finally:
            probe.close()
    return None
