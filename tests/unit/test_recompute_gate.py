# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Hits and write-downs only where loading beats recomputing: the load-rate estimator and the
prefix decision with a fake clock, then the chain over a gated in-memory tier whose reads take
as long as the test says (the clock moves while a read waits at its gate). No sleeps."""

from __future__ import annotations

import pytest

from kvstored.chain.chain import ChainPolicy
from kvstored.chain.load_rate import LoadRate
from kvstored.chain.recompute import TierLoad, expected_finish_s, reported_prefix
from kvstored.chain.writeback import WritePolicy
from kvstored.chunks.ids import TierKind
from kvstored.errors import InvalidRequest
from kvstored.namespaces import Namespace, NamespaceRegistry
from kvstored.tiers.base import TierCapabilities
from tests.support.tiers import GatedMemoryTier, make_chain, settle, store

MIB = 1 << 20
CHUNK = 64 << 10
TOKENS = 16  # per chunk: 4 KiB of KV per token
PREFILL = 1000.0  # tokens/s: break-even 4,096,000 B/s, 16 ms to recompute a chunk
NS = Namespace("ns", "m", "uint8", CHUNK, "", 32, TOKENS, "", PREFILL, CHUNK // TOKENS)
PLAIN = Namespace("plain", "m", "uint8", CHUNK, "", 32, TOKENS)  # gave no rates: every hit counts
SLOW, FAST = 1 * MIB, 100 * MIB  # bytes/s, either side of the break-even
PROBE_S = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


# -- the estimator --------------------------------------------------------------------------------


def test_a_rate_is_bytes_per_busy_second_and_follows_a_changed_tier():
    clock = FakeClock()
    rate = LoadRate(weight=0.5, clock=clock)
    assert not rate.estimate().known and rate.estimate().bytes_per_s == 0
    began = rate.begin()
    clock.now = 1.0
    rate.end(began, MIB, ok=True)
    assert rate.estimate().bytes_per_s == MIB and rate.estimate().age_s == 0
    # Two reads side by side, 2 MiB in 2 s of busy time: the tier's throughput, not each read's
    a, b = rate.begin(), rate.begin()
    clock.now = 3.0
    rate.end(a, MIB, ok=True)
    rate.end(b, MIB, ok=True)
    assert rate.estimate().bytes_per_s == MIB and rate.estimate().samples == 3
    # Idle time between reads is not busy time; a failed read is no sample
    clock.now = 100.0
    began = rate.begin()
    clock.now = 100.25
    rate.end(began, MIB, ok=True)  # 4 MiB/s: half way there with weight 0.5
    assert rate.estimate().bytes_per_s == 2.5 * MIB
    began = rate.begin()
    clock.now = 200.0
    rate.end(began, MIB, ok=False)
    assert rate.estimate().samples == 4 and rate.estimate().age_s == 99.75
    for _ in range(20):
        rate.record(FAST)
    assert rate.estimate().bytes_per_s == pytest.approx(FAST, rel=1e-3)


def test_reads_served_as_one_batch_are_each_the_batch_s_throughput():
    """A peer fetches a turn's chunks as one batch: 8 reads start together and end within
    microseconds of each other after 80 ms. Each is 8 MiB / 80 ms, however their ends fall (not
    one 1 MiB / 80 ms sample and seven near-instant ones); reads that overlap in part are each
    charged their share of the time they overlap."""
    clock = FakeClock()
    rate = LoadRate(weight=1.0, clock=clock)  # (the estimate is the last sample)
    began = [rate.begin() for _ in range(8)]
    clock.now = 0.08
    samples = []
    for i, b in enumerate(began):
        clock.now += 1e-6 * i
        rate.end(b, MIB, ok=True)
        samples.append(rate.estimate().bytes_per_s)
    assert samples == pytest.approx([100 * MIB] * 8, rel=0.01)
    # Overlapping in part: A alone for 1 s, then A and B for 1 s, then B alone for 1 s
    clock.now = 10.0
    a = rate.begin()
    clock.now = 11.0
    b = rate.begin()
    clock.now = 12.0
    rate.end(a, 3 * MIB, ok=True)  # 1 s + 1/2 s
    assert rate.estimate().bytes_per_s == pytest.approx(2 * MIB)
    clock.now = 13.0
    rate.end(b, 3 * MIB, ok=True)  # 1/2 s + 1 s
    assert rate.estimate().bytes_per_s == pytest.approx(2 * MIB)


# -- the decision ---------------------------------------------------------------------------------


def test_the_reported_prefix_stops_where_loading_stops_paying():
    t_c = NS.recompute_chunk_s
    assert NS.recompute_bytes_per_s == PREFILL * CHUNK // TOKENS and t_c == pytest.approx(0.016)
    fast, slow, unknown = TierLoad(FAST, 0), TierLoad(SLOW, 0), TierLoad(0, 0)
    ram = [None, None]
    assert reported_prefix(ram + [0, 0, 0], CHUNK, t_c, [fast]) == 5
    assert reported_prefix(ram + [0, 0, 0], CHUNK, t_c, [slow]) == 2  # RAM hits always count
    assert reported_prefix(ram + [0, 0, 0], CHUNK, t_c, [unknown]) == 5  # not measured: optimistic
    assert reported_prefix([0, 1, 0, 1], CHUNK, t_c, [fast, slow]) == 1  # up to the slow tier's first chunk
    # A queue in front of a fast tier: a short prefix does not pay for the wait, a long one does
    queued = TierLoad(FAST, 100)  # ~62 ms of loads ahead, ~4 recomputed chunks' worth
    assert expected_finish_s(queued, 1, CHUNK) == pytest.approx(101 * CHUNK / FAST)
    assert reported_prefix([0, 0], CHUNK, t_c, [queued]) == 0
    assert reported_prefix([0] * 8, CHUNK, t_c, [queued]) == 8


def test_bad_rates_are_refused_naming_the_field():
    registry = NamespaceRegistry(64 * MIB)
    for rate in (float("nan"), -1.0, float("inf")):
        with pytest.raises(InvalidRequest, match="prefill_tokens_per_s"):
            registry.register("m", "bf16", CHUNK, "", b"", 32, TOKENS, rate, 4096)
    with pytest.raises(InvalidRequest, match="kv_bytes_per_token"):
        registry.register("m", "bf16", CHUNK, "", b"", 32, TOKENS, PREFILL, CHUNK + 1)
    with pytest.raises(InvalidRequest, match="needs kv_bytes_per_token"):
        registry.register("m", "bf16", CHUNK, "", b"", 32, 0, PREFILL, 0)
    # Bytes per token follow from block_tokens; a later registration without rates keeps them
    ns = registry.register("m", "bf16", CHUNK, "", b"", 32, TOKENS, PREFILL, 0)
    assert ns.kv_bytes_per_token == CHUNK // TOKENS
    assert registry.register("m", "bf16", CHUNK, "", b"", 32).recompute_bytes_per_s == ns.recompute_bytes_per_s
    assert registry.register("m", "bf16", CHUNK, "", b"", 32, 0, 2 * PREFILL, 4096).prefill_tokens_per_s == 2 * PREFILL


# -- the chain ------------------------------------------------------------------------------------


@pytest.fixture
async def rig():
    made = []

    async def make(policy: ChainPolicy | None = None):
        clock = FakeClock()
        tier = GatedMemoryTier()
        namespaces = {NS.namespace_id: NS, PLAIN.namespace_id: PLAIN}
        chain = make_chain(
            [(tier, TierCapabilities())],
            pool=16 * CHUNK,
            policy=policy or ChainPolicy(writeback_wait_s=60.0, rate_probe_s=PROBE_S),
            namespaces=namespaces.get,
            clock=clock,
        )
        await chain.start()
        made.append(chain)
        return chain, tier, clock

    yield make
    for chain in made:
        await chain.close()


def below_ram(tier: GatedMemoryTier, ns: Namespace, keys: range) -> list[bytes]:
    for i in keys:
        tier.data[(ns.namespace_id, key(i))] = bytes([i]) * CHUNK
    return [key(i) for i in keys]


async def timed_promotion(chain, tier, clock, ns, k: bytes, seconds: float) -> None:
    """A lookup of `k` whose promotion's read takes `seconds` on the fake clock."""
    tier.close_gate("read")
    await chain.lookup(ns, [k])
    await tier.until_waiting("read")  # the lookup started its promotion
    clock.now += seconds
    tier.open_gate("read")
    await settle(lambda: chain.ram.contains_many(ns.namespace_id, [k]) == [True], "the chunk is in RAM")


async def test_a_slow_tier_s_hits_are_not_reported_until_a_probe_finds_it_fast(rig):
    chain, tier, clock = await rig()
    keys = below_ram(tier, NS, range(6))
    rate = chain.lower[0].load_rate
    rate.record(SLOW)
    assert await chain.lookup(NS, keys[:3]) == [TierKind.NONE] * 3
    assert chain.gate.skipped[0].hits == 3 and tier.calls["read"] == 0  # nothing loaded for nothing
    # RAM hits always count; a namespace that gave no rates sees every hit
    await store(chain, NS, key(100), 1)
    assert await chain.lookup(NS, [key(100), keys[0]]) == [TierKind.RAM, TierKind.NONE]
    plain = below_ram(tier, PLAIN, range(2))
    assert await chain.lookup(PLAIN, plain) == [TierKind.FS] * 2
    await settle(lambda: all(chain.ram.contains_many(PLAIN.namespace_id, plain)), "plain's chunks promoted")
    reads = tier.calls["read"]
    # Once the last measurement is probe_s old, the hits one lookup skipped are promoted, side by
    # side as a load would read them, to measure the tier; the next lookup's are not
    clock.now += PROBE_S
    tier.close_gate("read")
    assert await chain.lookup(NS, keys[1:3]) == [TierKind.NONE] * 2
    assert await chain.lookup(NS, keys[3:4]) == [TierKind.NONE]
    assert chain.gate.skipped[0].probes == 2
    await tier.until_waiting("read", 2)
    assert tier.calls["read"] == reads + 2
    clock.now += 2 * CHUNK / (500 * MIB)  # the tier is fast again
    tier.open_gate("read")
    await settle(lambda: chain.ram.contains_many(NS.namespace_id, keys[1:3]) == [True] * 2, "the probe landed")
    assert chain.lower[0].load_rate.estimate().bytes_per_s > NS.recompute_bytes_per_s
    assert await chain.lookup(NS, keys[1:5]) == [TierKind.RAM, TierKind.RAM, TierKind.FS, TierKind.FS]


async def test_a_fast_tier_that_turns_slow_loses_its_hits(rig):
    chain, tier, clock = await rig()
    keys = below_ram(tier, NS, range(24))
    await timed_promotion(chain, tier, clock, NS, keys[0], CHUNK / FAST)
    assert await chain.lookup(NS, keys[1:2]) == [TierKind.FS]  # (its promotion measures it again)
    await settle(lambda: chain.ram.contains_many(NS.namespace_id, [keys[1]]) == [True], "promoted")
    skipped = chain.gate.skipped[0].hits
    for i in range(2, 24):  # each load now slow: the estimate falls below the break-even in ~10
        tier.close_gate("read")
        if await chain.lookup(NS, keys[i : i + 1]) == [TierKind.NONE]:
            break
        await tier.until_waiting("read")
        clock.now += CHUNK / SLOW
        tier.open_gate("read")
        await settle(lambda k=keys[i]: chain.ram.contains_many(NS.namespace_id, [k]) == [True], "promoted")
    else:
        pytest.fail("a tier that turned slow kept its hits")
    assert chain.gate.skipped[0].hits == skipped + 1
    assert chain.lower[0].load_rate.estimate().bytes_per_s < NS.recompute_bytes_per_s


async def test_write_downs_skip_a_tier_that_cannot_beat_recomputing(rig):
    chain, tier, clock = await rig(ChainPolicy(write_policy=WritePolicy.WRITE_THROUGH, rate_probe_s=PROBE_S))
    await store(chain, NS, key(0), 0)  # rate unknown: written down
    await settle(lambda: len(tier.data) == 1, "the first write-down")
    chain.lower[0].load_rate.record(SLOW)
    for i in range(1, 4):
        await store(chain, NS, key(i), i)
    await store(chain, PLAIN, key(9), 9)  # no rates: not gated
    await settle(lambda: (PLAIN.namespace_id, key(9)) in tier.data, "plain's write-down")
    assert (NS.namespace_id, key(1)) not in tier.data and chain.gate.skipped[0].admissions == 3
    clock.now += PROBE_S  # due a measurement: one write-down goes through, for reads to measure
    await store(chain, NS, key(4), 4)
    await settle(lambda: (NS.namespace_id, key(4)) in tier.data, "the probe's write-down")
    await store(chain, NS, key(5), 5)
    assert chain.gate.skipped[0].admissions == 4 and chain.gate.skipped[0].probes == 1
    chain.lower[0].load_rate.record(FAST)
    for _ in range(10):
        chain.lower[0].load_rate.record(FAST)
    await store(chain, NS, key(6), 6)
    await settle(lambda: (NS.namespace_id, key(6)) in tier.data, "written down once the tier is fast")


async def test_the_gate_can_be_turned_off(rig):
    chain, tier, _ = await rig(ChainPolicy(recompute_gate=False))
    keys = below_ram(tier, NS, range(2))
    chain.lower[0].load_rate.record(SLOW)
    assert await chain.lookup(NS, keys) == [TierKind.FS] * 2
    assert chain.gate.skipped[0].hits == 0
