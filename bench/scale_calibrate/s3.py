# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""S3 PUT/GET latency per chunk."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any

from bench.scale_calibrate.common import SMALL


def measure_s3(kind: str, chunk_bytes: int, reps: int) -> dict[str, Any]:
    if kind == "none":
        return {"server": None, "note": "--s3 none: not measured"}
    import boto3

    from tests.support.s3 import MotoServer, RadosGW

    print("S3 PUT/GET latency", flush=True)
    errors, server, endpoint, which = [], None, None, ""
    for which in ["radosgw", "moto"] if kind == "auto" else [kind]:
        server = RadosGW(memstore_bytes=max(256 << 20, 4 * reps * chunk_bytes)) if which == "radosgw" else MotoServer()
        try:
            endpoint = server.start()
            break
        except Exception as exc:  # noqa: BLE001 - try the next kind, report every reason
            errors.append(f"{which}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}")
            with contextlib.suppress(Exception):
                server.stop()
            server = None
    if server is None or endpoint is None:
        return {"server": None, "note": "no S3 server started: " + "; ".join(errors)}
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint.url,
            aws_access_key_id=endpoint.access_key,
            aws_secret_access_key=endpoint.secret_key,
            region_name=endpoint.region,
        )
        bucket = f"scale-calibrate-{os.getpid()}"
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="warm", Body=b"x")  # the first PUT creates radosgw's pools (~2 s)
        out: dict[str, Any] = {"server": which, "chunk_bytes": chunk_bytes, "reps": reps}
        for label, size in (("chunk", chunk_bytes), ("small", SMALL)):
            body = os.urandom(size)
            puts, gets = [], []
            for i in range(reps):
                t0 = time.perf_counter()
                s3.put_object(Bucket=bucket, Key=f"{label}/{i}", Body=body)
                puts.append(time.perf_counter() - t0)
            for i in range(reps):
                t0 = time.perf_counter()
                s3.get_object(Bucket=bucket, Key=f"{label}/{i}")["Body"].read()
                gets.append(time.perf_counter() - t0)
            out[f"put_{label}_ms"] = statistics.median(puts) * 1e3
            out[f"get_{label}_ms"] = statistics.median(gets) * 1e3
        out["basis"] = (
            f"boto3 PUT then GET of {reps} objects of {chunk_bytes >> 20} MiB and of 4 KiB, one at a time, "
            f"medians, against {which} on loopback"
            + (
                " (moto_server keeps objects in RAM: not an object store's latency)"
                if which == "moto"
                else " (a memstore OSD: no disks, no network: latencies are a floor)"
            )
        )
        if errors:
            out["note"] = "; ".join(errors)
        return out
    finally:
        server.stop()
