# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Real S3 endpoints for tests: Ceph radosgw (deploy/ceph/start_rgw.sh), moto_server, and a
fault-injecting HTTP proxy.

- RadosGW: a throwaway single-node Ceph cluster in a temp dir on free loopback ports (~2-3 s);
  the gateway alone can be stopped and started again (the objects survive), or frozen (SIGSTOP).
- MotoServer: `moto_server` as a subprocess on a free (or given) loopback port (everything in RAM).
- FaultProxy: an aiohttp reverse proxy on the test's loop that answers the next N requests with an
  S3 error (503 SlowDown by default) instead of forwarding them, and counts what it sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.support.needs import Needs, require
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
START_RGW = REPO / "deploy" / "ceph" / "start_rgw.sh"
STOP_RGW = REPO / "deploy" / "ceph" / "stop_rgw.sh"
CEPH_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph-authtool", "ceph", "curl")
INSTALL_HINT = (
    "run deploy/install-system-deps.sh (it installs the Debian packages ceph-mon ceph-osd radosgw "
    "curl with --no-install-recommends)"
)


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def client_kwargs(self) -> dict:
        """Keyword arguments for aiobotocore's create_client("s3", ...)."""
        return {
            "endpoint_url": self.url,
            "region_name": self.region,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
        }

    def tier_kwargs(self) -> dict:
        """Keyword arguments for S3Tier(...)."""
        return {
            "endpoint_url": self.url,
            "region": self.region,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
        }


def wait_for_port(port: int, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server on port {port} exited before it listened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


class RgwUnavailable(RuntimeError):
    """Ceph is not installed here."""


class RadosGW:
    """A single-node Ceph cluster with radosgw on loopback, in its own temp dir."""

    ACCESS_KEY = "kvak"
    SECRET_KEY = "kvsecret"

    def __init__(self, memstore_bytes: int = 1 << 30) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvrgw-"))  # short: admin socket paths must fit
        self.memstore_bytes = memstore_bytes
        self.endpoint: S3Endpoint | None = None
        self._watchdog: subprocess.Popen | None = None

    @staticmethod
    def check_installed() -> None:
        missing = [b for b in CEPH_BINARIES if shutil.which(b) is None]
        if missing:
            raise RgwUnavailable(f"Ceph radosgw is not installed (missing {', '.join(missing)}): {INSTALL_HINT}")

    def start(self) -> S3Endpoint:
        require(Needs.RADOSGW)
        self.check_installed()
        env = dict(
            os.environ,
            RGW_ACCESS_KEY=self.ACCESS_KEY,
            RGW_SECRET_KEY=self.SECRET_KEY,
            RGW_MEMSTORE_BYTES=str(self.memstore_bytes),
        )
        error = ""
        for _ in range(3):  # a free port can be taken between the probe and the bind: try others
            rgw_port, mon_port = free_port(), free_port()
            if rgw_port == mon_port:
                continue
            out = subprocess.run(
                [str(START_RGW), str(self.dir), str(rgw_port), str(mon_port)],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            if out.returncode == 0:
                url = out.stdout.strip().splitlines()[-1]
                self.endpoint = S3Endpoint(url, self.ACCESS_KEY, self.SECRET_KEY)
                self._start_watchdog()
                return self.endpoint
            error = out.stderr
        raise RuntimeError(f"radosgw did not start:\n{error}")

    def stop_gateway(self) -> None:
        """Stop radosgw only (the mon and the OSD keep the objects)."""
        subprocess.run([str(STOP_RGW), "--rgw-only", str(self.dir)], check=True, timeout=60)

    def gateway_pid(self) -> int:
        return int((self.dir / "run" / "client.rgw.a.pid").read_text().strip())

    @contextlib.contextmanager
    def gateway_frozen(self):
        """radosgw stopped with SIGSTOP for the duration: connections are accepted by the kernel,
        requests get no answer (a hung gateway, not a dead one). SIGCONT on the way out."""
        pid = self.gateway_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield pid
        finally:
            os.kill(pid, signal.SIGCONT)

    def start_gateway(self) -> None:
        out = subprocess.run([str(START_RGW), "--rgw-only", str(self.dir)], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"radosgw did not restart:\n{out.stderr}")

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
        subprocess.run([str(STOP_RGW), str(self.dir)], timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _start_watchdog(self) -> None:
        """The Ceph daemons outlive a killed test run (they daemonize): a small shell in its own
        session stops them and removes the directory once this process is gone."""
        script = 'while kill -0 "$0" 2>/dev/null; do sleep 1; done; "$1" "$2" >/dev/null 2>&1; rm -rf "$2"'
        self._watchdog = subprocess.Popen(
            ["bash", "-c", script, str(os.getpid()), str(STOP_RGW), str(self.dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def __enter__(self) -> S3Endpoint:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def radosgw_or_fail() -> Iterator[tuple[RadosGW, S3Endpoint]]:
    """A throwaway radosgw for a test module. Without radosgw the test fails (it is never
    skipped): `make test` installs it."""
    require(Needs.RADOSGW)
    try:
        RadosGW.check_installed()
    except RgwUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    gateway = RadosGW()
    with gateway as endpoint:
        yield gateway, endpoint


class MotoServer:
    """moto_server in a subprocess on 127.0.0.1 (a fixed port can be given, e.g. to bring one up
    where a tier already points)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = S3Endpoint(f"http://127.0.0.1:{self.port}", "testing", "testing")
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    def start(self) -> S3Endpoint:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        try:
            wait_for_port(self.port, 60, alive=lambda: self._proc.poll() is None)
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"moto_server did not start: {exc}\n{self.output()}") from None
        return self.endpoint

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def __enter__(self) -> S3Endpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies (even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


_HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass
class FaultProxy:
    """Forwards HTTP to `upstream`, except that the next `fail_next` requests are answered with
    `status` and an S3 error `code`, and that while `hang` is set requests get no answer at all
    (a black hole). Use with `async with`; `url` is where clients point."""

    upstream: str
    fail_next: int = 0
    status: int = 503
    code: str = "SlowDown"
    seen: int = 0  # requests received
    failed: int = 0  # requests answered with the fault
    hang: bool = False
    in_flight: int = 0
    max_in_flight: int = 0  # most requests handled at once
    url: str = ""
    _runner: web.AppRunner | None = field(default=None, repr=False)
    _session: aiohttp.ClientSession | None = field(default=None, repr=False)
    _released: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    async def __aenter__(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        self._released.set()  # hung requests finish (with the fault)
        assert self._runner is not None and self._session is not None
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if self.hang:
            await self._released.wait()
        if self.fail_next > 0 or self.hang:
            self.fail_next -= 1
            self.failed += 1
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{self.code}</Code>'
                f"<Message>injected by FaultProxy</Message></Error>"
            ).encode()
            return web.Response(status=self.status, body=xml, content_type="application/xml")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        assert self._session is not None
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body, allow_redirects=False
        ) as upstream:
            payload = await upstream.read()
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
            if request.method == "HEAD":  # keep the object's length (there is no body to measure)
                response = web.StreamResponse(status=upstream.status, headers=out_headers)
                response.content_length = upstream.content_length or 0
                await response.prepare(request)
                return response
            return web.Response(status=upstream.status, body=payload, headers=out_headers)
