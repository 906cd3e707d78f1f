# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A tier that turns slower than recomputing, then fast again, through a real daemon: S3 (the
moto test server) behind a throttled TCP proxy (tests/support/throttle.py). While the link is
slower than the namespace's break-even, its hits are not reported and write-downs to it are
skipped (both counted); once it is fast again, the daemon's probes measure it and its hits come
back. Every wait is on the daemon's counters and answers; loads are checked byte for byte."""

from __future__ import annotations

import itertools
import uuid

import grpc
import numpy as np
import pytest

from kvstored_client import NamespaceSpec, Tier
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.integration.test_metrics import scrape
from tests.support.data import make_keys, payloads
from tests.support.rpc import raw, rpc_error
from tests.support.s3 import MotoServer
from tests.support.throttle import ThrottledProxy
from tests.support.wait import wait_for

CHUNK = 256 << 10
TOKENS = 16  # per chunk: 16 KiB of KV per token
PREFILL = 128.0  # tokens/s: a break-even of 2 MiB/s, 125 ms to recompute a chunk
BREAK_EVEN = PREFILL * CHUNK / TOKENS
SLOW = 512 << 10  # bytes/s through the proxy: a chunk takes 0.5 s to load, 4x its recompute time
WAIT_S = 120.0  # a hang guard only: every wait ends on a state


@pytest.fixture
def slow_s3():
    with MotoServer() as endpoint, ThrottledProxy(int(endpoint.url.rsplit(":", 1)[1])) as proxy:
        yield endpoint, proxy


def s3_stats(d) -> pb.TierStats:
    return next(t for t in d.stats().tiers if t.name == "s3")


def test_a_slow_tier_loses_its_hits_and_gets_them_back_when_fast_again(daemon_factory, slow_s3, ns_name):
    endpoint, proxy = slow_s3
    spec = (
        f"kind=s3,bucket=kv-{uuid.uuid4().hex[:8]},endpoint_url={proxy.url},access_key={endpoint.access_key},"
        f"secret_key={endpoint.secret_key},region=us-east-1,timeout_s=30,pack_bytes=0"
    )
    d = daemon_factory(
        [
            "--tiers",
            spec,
            "--write-policy",
            "write-through",
            "--rate-probe-seconds",
            "0.2",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        cpu_bytes="2MiB",
    )
    keys = make_keys("slow-tier", 64)  # (2 MiB of RAM holds 8 chunks)
    with d.client(deadline_s=60.0) as kv:
        ns = kv.register_namespace(
            NamespaceSpec(
                model=ns_name,
                dtype="u8",
                chunk_bytes=CHUNK,
                block_tokens=TOKENS,
                prefill_tokens_per_s=PREFILL,
                kv_bytes_per_token=CHUNK // TOKENS,
            )
        )
        for i in range(0, len(keys), 4):  # the rate is not known yet: every chunk goes to S3 too
            assert kv.store(ns, keys[i : i + 4], payloads(keys[i : i + 4], CHUNK)).stored == 4
        assert wait_for(lambda: s3_stats(d).stored_chunks == len(keys), WAIT_S)
        cursor = itertools.cycle(keys)

        def load_next() -> Tier:
            """Look up the next chunk that is not in RAM; load it where reported (bytes checked)."""
            while (tier := kv.lookup(ns, [k := next(cursor)]).tiers[0]) is Tier.RAM:
                pass
            if tier is not Tier.NONE:
                out = np.zeros((1, CHUNK), dtype=np.uint8)
                assert kv.load(ns, [k], out) == 1 and np.array_equal(out, payloads([k], CHUNK))
            return tier

        # Fast: loads measure S3 above the break-even, and its hits count
        assert load_next() is Tier.S3 and load_next() is Tier.S3
        assert s3_stats(d).load_bytes_per_s > BREAK_EVEN and s3_stats(d).skipped_slow_hits == 0

        # Slower than recomputing: the loads still reported measure it, until the hits stop
        proxy.bytes_per_s = SLOW
        assert wait_for(lambda: load_next() is Tier.NONE, WAIT_S)
        stats = s3_stats(d)
        assert stats.skipped_slow_hits >= 1 and 0 < stats.load_bytes_per_s < BREAK_EVEN
        # ...and new chunks are not written down to it (a probe may let one through)
        fresh = make_keys("slow-tier-fresh", 4)
        assert kv.store(ns, fresh, payloads(fresh, CHUNK)).stored == 4
        assert wait_for(lambda: s3_stats(d).skipped_slow_writedowns >= 3, WAIT_S)
        assert s3_stats(d).stored_chunks <= len(keys) + 1

        # Fast again: a probe promotes a skipped chunk, measures it, and the hits come back
        proxy.bytes_per_s = 0
        assert wait_for(lambda: load_next() is Tier.S3, WAIT_S)
        assert s3_stats(d).rate_probes >= 1 and s3_stats(d).load_bytes_per_s > BREAK_EVEN

    metrics = scrape(d)
    assert 'kvstored_tier_skipped_slow_hits_total{kind="s3",tier="s3"}' in metrics
    assert 'kvstored_tier_skipped_slow_writedowns_total{kind="s3",tier="s3"}' in metrics


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"prefill_tokens_per_s": float("nan"), "kv_bytes_per_token": 4096}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": -5.0, "kv_bytes_per_token": 4096}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": 100.0, "kv_bytes_per_token": CHUNK + 1}, "kv_bytes_per_token"),
        ({"prefill_tokens_per_s": 100.0}, "kv_bytes_per_token"),  # neither it nor block_tokens
    ],
)
def test_bad_recompute_rates_are_invalid_argument(daemon, fields, named):
    with raw(daemon.socket) as conn:
        spec = pb.NamespaceSpec(model="test/bad-rates", dtype="u8", chunk_bytes=CHUNK, **fields)
        err = rpc_error(conn.call, "RegisterNamespace", pb.RegisterNamespaceRequest(spec=spec))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and named in (err.details() or "")
        conn.register("test/still-serving", CHUNK)  # the daemon keeps serving
