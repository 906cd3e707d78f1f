# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The physical limits under each tier, measured at the start and the end of a sweep: memcpy, raw O_DIRECT
reads, raw S3 GETs; with --nodes, a raw TCP socket on loopback beside the peer tier."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.buffers import aligned_pool
from bench.lib.limits import ODirectFiles, memcpy_pieces_gib_s
from bench.lib.report import GIB, MIB
from bench.lib.s3 import S3, raw_s3_get
from bench.multiturn.model import FS_IO_THREADS, S3_INFLIGHT

LIMIT_KEYS = ("memcpy", "odirect_stream", "odirect_batched", "s3_get")


@dataclass
class Limits:
    """GiB/s of the hardware under each tier, one sample per round: the tiers' ceilings."""

    memcpy: list[float] = field(default_factory=list)  # 2 MiB pieces, one thread
    odirect_stream: list[float] = field(default_factory=list)  # preadv, FS_IO_THREADS threads, all queued
    odirect_batched: list[float] = field(default_factory=list)  # the same, one load call's chunks at a time
    s3_get: list[float] = field(default_factory=list)  # aiobotocore GETs, S3_INFLIGHT in flight
    batch_chunks: int = 0
    notes: list[str] = field(default_factory=list)
    raw_tcp: list[float] | None = None  # with --nodes: a raw TCP socket on loopback (None: not measured at all)

    def median(self, name: str) -> float | None:
        samples = getattr(self, name)
        return float(np.median(samples)) if samples else None

    def to_json(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        return {**fields, "medians": {k: self.median(k) for k in LIMIT_KEYS}}


def odirect_reads(workdir: Path, chunk_bytes: int, batch: int, total: int, rounds: int) -> tuple[list, list]:
    """GiB/s reading one file per chunk: all queued at once, and `batch` at a time (the loader's pattern)."""
    n = total // chunk_bytes
    files = ODirectFiles(workdir, n, chunk_bytes, FS_IO_THREADS)
    buf = aligned_pool(n * chunk_bytes)
    np.frombuffer(buf, dtype=np.uint8)[:] = 7
    view, gib = memoryview(buf), n * chunk_bytes / GIB
    try:
        files.write(view)
        rates = [(gib / files.read(view), gib / files.read(view, batch)) for _ in range(rounds)]  # (stream, batched)
    finally:
        files.close()
        view.release()
        buf.close()
    return [stream for stream, _ in rates], [batched for _, batched in rates]


def s3_gets(s3: S3, chunk_bytes: int, objects: int, rounds: int) -> list[float]:
    """GiB/s of raw GETs of `objects` objects of chunk_bytes, S3_INFLIGHT in flight, per round."""
    bucket = s3.new_bucket()
    client, body = s3.client(), os.urandom(chunk_bytes)
    try:
        for i in range(objects):
            client.put_object(Bucket=bucket, Key=f"raw/{i:05d}", Body=body)
        return [raw_s3_get(s3.endpoint, bucket, S3_INFLIGHT)[0] for _ in range(rounds)]
    finally:
        s3.empty_bucket(bucket)


def measure_limits(limits: Limits, workdir: Path, chunk_bytes: int, batch: int, s3: S3 | None) -> None:
    """One round of every limit measurement (appended to `limits`); a measurement that fails is noted."""
    total, rounds = 256 * MIB, 3  # bytes each measurement moves; samples of each (raw TCP: one)
    limits.batch_chunks = batch
    limits.memcpy += memcpy_pieces_gib_s(chunk_bytes, total, rounds)
    try:
        stream, batched = odirect_reads(workdir, chunk_bytes, batch, total, rounds)
        limits.odirect_stream += stream
        limits.odirect_batched += batched
    except OSError as exc:  # a filesystem without O_DIRECT (tmpfs): no raw figure, said so
        limits.notes.append(f"raw O_DIRECT on {workdir}: {exc}")
    if s3 is not None:
        try:
            limits.s3_get += s3_gets(s3, chunk_bytes, 48, rounds)
        except Exception as exc:  # noqa: BLE001 - the tiers' figures stand without it
            limits.notes.append(f"raw S3 GET: {type(exc).__name__}: {exc}")
    if limits.raw_tcp is not None:
        try:  # bench/lib/raw_net.py: sendall from a populated mmap, recv_into 16 slots
            from bench.lib.raw_net import Place, measure_raw

            limits.raw_tcp.append(measure_raw("tcp", Place("loopback"), total, chunk_bytes, 16).gib_s)
        except Exception as exc:  # noqa: BLE001 - the tiers' figures stand without it
            limits.notes.append(f"raw TCP: {type(exc).__name__}: {exc}")
