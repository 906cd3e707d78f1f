# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A TCP proxy on loopback whose answers flow at a set bandwidth: a slow link in front of a real
server (the S3 test server), slowed down or sped up while a daemon uses it.

Bytes from the upstream to the client share one timeline (one link for every connection), so
reads in parallel divide the bandwidth as they would on a real slow device or network. A plain
threaded relay: it runs beside the test, not on its event loop.
"""

from __future__ import annotations

import socket
import threading
import time

BLOCK = 16 << 10  # bytes relayed (and paced) at a time


class ThrottledProxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream_port`. `bytes_per_s` (0: no limit) may be
    changed at any time; it applies to the next block relayed."""

    def __init__(self, upstream_port: int, bytes_per_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.bytes_per_s = bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._link_free_at = 0.0  # monotonic time the link has sent everything paced so far
        self._closing = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for src, dst, paced in ((client, upstream, False), (upstream, client, True)):
                thread = threading.Thread(target=self._pump, args=(src, dst, paced), daemon=True)
                thread.start()

    def _pace(self, nbytes: int) -> None:
        rate = self.bytes_per_s
        if rate <= 0:
            return
        with self._lock:
            start = max(time.monotonic(), self._link_free_at)
            self._link_free_at = start + nbytes / rate
            until = self._link_free_at
        # (emulating the link's speed: the bytes leave when a link this slow would have sent them)
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _pump(self, src: socket.socket, dst: socket.socket, paced: bool) -> None:
        try:
            while data := src.recv(BLOCK):
                if paced:
                    self._pace(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            s.close()

    def __enter__(self) -> ThrottledProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
