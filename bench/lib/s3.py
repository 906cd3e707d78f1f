# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""An S3 server on loopback for the benchmarks: tests/support/s3.py's radosgw (a memstore OSD) or
moto_server (in RAM), with bucket chores and raw aiobotocore GETs (the S3 tier's client)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.s3 import MotoServer, RadosGW, S3Endpoint

GIB = 1 << 30
# --s3 values -> the servers tried, in order ("rgw" falls back to moto_server, "radosgw" does not)
ORDER = {"auto": ("radosgw", "moto"), "rgw": ("rgw", "moto"), "radosgw": ("radosgw",), "moto": ("moto",)}


@dataclass
class S3:
    """A started server: `kind` as tried ("rgw"/"radosgw" or "moto"); `note` says why it is moto
    when radosgw was asked for."""

    kind: str
    endpoint: S3Endpoint
    note: str
    server: Any
    started_s: float
    _buckets: int = field(default=0, repr=False)

    @property
    def is_rgw(self) -> bool:
        return self.kind != "moto"

    def pids(self) -> list[int]:
        """The server's processes (radosgw, ceph-osd, ceph-mon; or moto_server), for CPU accounting."""
        proc = getattr(self.server, "_proc", None)
        if proc is not None:
            return [proc.pid]
        out = []
        for pidfile in Path(getattr(self.server, "dir", "/nonexistent"), "run").glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                out.append(int(pidfile.read_text().strip()))
        return out

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", **self.endpoint.client_kwargs())

    def new_bucket(self, name: str = "") -> str:
        """A bucket, then one PUT/DELETE: radosgw creates its data pool on the first PUT (~2 s)."""
        self._buckets += 1
        name = name or f"kvstored-bench-{os.getpid()}-{self._buckets}"
        s3 = self.client()
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=name)
        s3.put_object(Bucket=name, Key="warmup", Body=b"x" * 4096)
        s3.delete_object(Bucket=name, Key="warmup")
        return name

    def empty_bucket(self, name: str, delete: bool = True) -> None:
        """Delete the objects (radosgw keeps them in the memstore OSD, in RAM), then the bucket."""
        s3 = self.client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                s3.delete_objects(Bucket=name, Delete={"Objects": objects, "Quiet": True})
        if delete:
            s3.delete_bucket(Bucket=name)

    def tier_spec(self, bucket: str, nbytes: int) -> str:
        """The daemon's --tiers value for an S3 tier on `bucket`."""
        ep = self.endpoint
        return (
            f"kind=s3,bucket={bucket},endpoint_url={ep.url},region={ep.region},access_key={ep.access_key},"
            f"secret_key={ep.secret_key},bytes={nbytes}"
        )

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.stop()


def start_s3(kind: str, memstore_bytes: int) -> S3:
    """The first server of ORDER[kind] that starts (radosgw's memstore OSD: `memstore_bytes` of RAM);
    RuntimeError if none does."""
    errors = []
    for k in ORDER[kind]:
        server = MotoServer() if k == "moto" else RadosGW(memstore_bytes=memstore_bytes)
        t0 = time.perf_counter()
        try:
            endpoint = server.start()
        except Exception as exc:  # noqa: BLE001 - fall back, then report
            text = str(exc).strip()
            errors.append(f"{k}: {text.splitlines()[0] if text else repr(exc)}")
            with contextlib.suppress(Exception):
                server.stop()
            continue
        note = f"S3: radosgw did NOT start ({'; '.join(errors)}); S3 figures are against moto_server (Python, in RAM)"
        return S3(k, endpoint, note if errors else "", server, time.perf_counter() - t0)
    raise RuntimeError("no S3 server: " + "; ".join(errors))


def raw_config(inflight: int, timeout_s: float | None = None) -> Any:
    """aiobotocore's settings as the S3 tier's: no retries, path addressing, no extra checksums."""
    from aiobotocore.config import AioConfig

    timeouts: dict[str, Any] = {}
    if timeout_s is not None:
        timeouts = {"connect_timeout": min(timeout_s, 2.0), "read_timeout": timeout_s, "tcp_keepalive": True}
    return AioConfig(
        max_pool_connections=inflight,
        retries={"total_max_attempts": 1},
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        **timeouts,
    )


def raw_s3_get(endpoint: S3Endpoint, bucket: str, inflight: int) -> tuple[float, float]:
    """GET every object of the bucket, `inflight` at a time, bodies read and dropped (aiobotocore,
    as the S3 tier uses it): (GiB/s, this process's CPU s/GiB), from the first GET to the last."""
    from aiobotocore.session import get_session

    async def run() -> tuple[float, float]:
        async with get_session().create_client("s3", config=raw_config(inflight), **endpoint.client_kwargs()) as client:
            names = []
            async for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                names += [o["Key"] for o in page.get("Contents", [])]
            slots = asyncio.Semaphore(inflight)
            total = 0

            async def get(name: str) -> None:
                nonlocal total
                async with slots:
                    response = await client.get_object(Bucket=bucket, Key=name)
                    async with response["Body"] as stream:
                        body = await stream.read()
                total += len(body)  # (not `total += await ...`: that reads `total` before the await)

            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(get(n) for n in names))
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            return total / GIB / wall, cpu / (total / GIB)

    return asyncio.run(run())
