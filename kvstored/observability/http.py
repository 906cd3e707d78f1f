# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The /metrics endpoint: a small HTTP/1.1 server on the daemon's own event loop (no thread).

It is bounded, since it may listen where anyone reaches it (a pod network): at most
MAX_CONNECTIONS open at once (more are closed as they come), a request's head must arrive
within REQUEST_TIMEOUT_S and fit MAX_HEAD_BYTES, and each connection serves one request. Idle
connections therefore cannot hold the daemon's file descriptors, which its clients' sockets
need."""

from __future__ import annotations

import asyncio
import gzip
import logging

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvstored.logs import LogLimiter

log = logging.getLogger(__name__)
limited = LogLimiter(log)  # (whoever reaches the port can send what it likes)

MAX_CONNECTIONS = 32
REQUEST_TIMEOUT_S = 5.0  # to read a request's head, and again to send the answer
MAX_HEAD_BYTES = 16 << 10
INDEX = b"kvstored: metrics at /metrics\n"


def split_host_port(addr: str) -> tuple[str, int]:
    """'127.0.0.1:9464' -> ('127.0.0.1', 9464); '[::1]:9464' -> ('::1', 9464)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, addr: str, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.addr = addr
        self.port: int | None = None
        self._registry = registry
        self._timeout_s = request_timeout_s
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Listen; raises OSError if the address is taken or invalid."""
        host, port = split_host_port(self.addr)
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True, limit=MAX_HEAD_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]  # the bound port, also when asked for port 0
        shown = f"[{host}]" if ":" in host else host
        log.info("metrics on http://%s:%d/metrics", shown, self.port)

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= MAX_CONNECTIONS:
            writer.transport.abort()  # (a scrape retries; a flood holds nothing)
            return
        self._connections.add(task)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._timeout_s)
            try:
                status, headers, body = self._answer(head)
            except Exception as exc:  # (a collector's bug: say so, keep serving)
                line = head.split(b"\r\n", 1)[0][:200]
                limited.log("answer", logging.ERROR, "metrics: cannot answer %r", line, exc_info=exc)
                status, headers, body = "500 Internal Server Error", [("Content-Type", "text/plain")], b"error\n"
            lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers)]
            lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
            writer.write("\r\n".join(lines).encode("latin-1") + (b"" if head.startswith(b"HEAD ") else body))
            writer.close()
            # A client that never reads would keep the unsent answer, and the socket, forever.
            await asyncio.wait_for(writer.wait_closed(), self._timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # (a slow, cut or oversized request, or a reader too slow: nothing more to do)
        finally:
            writer.transport.abort()  # (no-op once closed; else its buffer and fd go now)
            self._connections.discard(task)

    def _answer(self, head: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", [("Content-Type", "text/plain")], b"bad request line\n"
        method, target, _version = parts
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain")], b""
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        path = target.partition("?")[0]
        if path == "/":
            return "200 OK", [("Content-Type", "text/plain; charset=utf-8")], INDEX
        if path != "/metrics":
            return "404 Not Found", [("Content-Type", "text/plain")], b"not found: the metrics are at /metrics\n"
        try:
            encoder, content_type = choose_encoder(headers.get("accept", ""))  # (Prometheus sends one)
        except ValueError:
            return "400 Bad Request", [("Content-Type", "text/plain")], b"bad Accept header\n"

        body = encoder(self._registry)
        out = [("Content-Type", content_type)]
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=1)
            out.append(("Content-Encoding", "gzip"))
        return "200 OK", out, body
