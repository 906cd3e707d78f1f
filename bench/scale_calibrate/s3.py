# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""S3 PUT/GET latency per chunk."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from bench.scale_calibrate.common import SMALL, timed


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
            out[f"put_{label}_ms"], out[f"get_{label}_ms"] = put_get_ms(s3, bucket, label, os.urandom(size), reps)
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


def put_get_ms(s3: Any, bucket: str, prefix: str, body: bytes, reps: int) -> tuple[float, float]:
    """Median latencies (ms) of PUTting `reps` objects of `body` one at a time, then GETting each."""
    puts, gets = iter(range(reps)), iter(range(reps))
    put = timed(lambda: s3.put_object(Bucket=bucket, Key=f"{prefix}/{next(puts)}", Body=body), reps)
    get = timed(lambda: s3.get_object(Bucket=bucket, Key=f"{prefix}/{next(gets)}")["Body"].read(), reps)
    return put * 1e3, get * 1e3
