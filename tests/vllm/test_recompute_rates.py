# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Both vLLM integrations tell the daemon how fast the engine recomputes: the prefill rate from
their config option (or $KVSTORED_PREFILL_TOKENS_PER_S), KV bytes per token from the layout they
compute; the daemon accepts the registration and the chunks round-trip as before."""

from __future__ import annotations

import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvstored_client.vllm.namespace import PREFILL_ENV, prefill_rate
from tests.vllm.harness import Engine, exact, kvstored_tier, offload_keys
from tests.vllm.test_direct import DirectEngine
from tests.vllm.test_tier import store_and_cascade


def test_the_tier_registers_its_prefill_rate_and_bytes_per_token(vllm_daemon, monkeypatch):
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    keys = offload_keys("recompute-rates", 4)
    with Engine([kvstored_tier(vllm_daemon, prefill_tokens_per_s=5000.0)]) as engine:
        spec = engine.tier._namespaces._make_spec(36, b"")
        assert spec.prefill_tokens_per_s == 5000.0 and spec.block_tokens > 0
        assert spec.kv_bytes_per_token == engine.chunk_bytes // spec.block_tokens
        store_and_cascade(engine, keys)  # registered with the rates: accepted, and served
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [LookupResult.HIT] * len(keys)
        assert exact(engine.load(ctx, keys), keys)
        engine.finish(ctx)
    with Engine([kvstored_tier(vllm_daemon)]) as engine:  # no option, no variable: unknown
        assert engine.tier._namespaces._make_spec(36, b"").prefill_tokens_per_s == 0


def test_the_direct_spec_takes_the_rate_from_the_environment_for_every_rank(vllm_daemon, monkeypatch):
    monkeypatch.setenv(PREFILL_ENV, "2500")
    with DirectEngine(vllm_daemon, world_size=2) as engine:
        spec = engine.spec.namespace_spec(32, b"")
        assert spec.prefill_tokens_per_s == 2500.0
        # the parts of both ranks load through this daemon: the node's bytes per token
        assert spec.chunk_bytes == engine.spec.part_bytes and spec.block_tokens > 0
        assert spec.kv_bytes_per_token == min(spec.chunk_bytes, 2 * spec.chunk_bytes // spec.block_tokens)


@pytest.mark.parametrize("value", ["fast", "-1", "nan"])
def test_a_bad_prefill_rate_is_refused_naming_the_option(value, monkeypatch):
    monkeypatch.setenv(PREFILL_ENV, value)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        prefill_rate()
    assert prefill_rate(100) == 100.0  # the config option wins over the variable
