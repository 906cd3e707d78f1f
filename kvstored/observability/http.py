# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The /metrics endpoint: an aiohttp server on the daemon's own event loop (no extra thread)."""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

log = logging.getLogger(__name__)


def split_host_port(addr: str) -> tuple[str, int]:
    """'127.0.0.1:9464' -> ('127.0.0.1', 9464); '[::1]:9464' -> ('::1', 9464)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, addr: str) -> None:
        self.addr = addr
        app = web.Application()
        app.router.add_get("/metrics", make_aiohttp_handler(registry))
        app.router.add_get("/", _index)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self.port: int | None = None

    async def start(self) -> None:
        """Listen; raises OSError if the address is taken or invalid."""
        host, port = split_host_port(self.addr)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        self.port = self._runner.addresses[0][1]  # the bound port, also when asked for port 0
        shown = f"[{host}]" if ":" in host else host
        log.info("metrics on http://%s:%d/metrics", shown, self.port)

    async def stop(self) -> None:
        await self._runner.cleanup()


async def _index(request: web.Request) -> web.Response:
    return web.Response(text="kvstored: metrics at /metrics\n")
