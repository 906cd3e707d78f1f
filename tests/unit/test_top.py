# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstoredctl top's frames: rates are counter differences over the time between two Stats
answers, tiers are matched by name, counters that went back (a restarted daemon) give no rate,
and every rendered row splits into its columns."""

from __future__ import annotations

from kvstored import top
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

GIB = 1 << 30


def stats(**tiers: dict) -> pb.StatsResponse:
    kinds = {"ram": pb.TIER_KIND_RAM, "fs": pb.TIER_KIND_FS, "s3": pb.TIER_KIND_S3}
    return pb.StatsResponse(
        version="9.9",
        sessions=2,
        leases=3,
        reservations=1,
        regions=1,
        namespaces=4,
        tiers=[pb.TierStats(name=name, kind=kinds[name], **fields) for name, fields in tiers.items()],
    )


BEFORE = stats(
    ram=dict(
        capacity_bytes=4 * GIB,
        used_bytes=GIB,
        chunks=512,
        lookups=100,
        hits=50,
        written_bytes=10 * GIB,
        read_bytes=GIB,
        promotions=7,
        evictions=0,
        dropped_dirty=1,
    ),
    fs=dict(capacity_bytes=0, used_bytes=GIB, lookups=50, hits=0, written_bytes=GIB),
)
AFTER = stats(
    ram=dict(
        capacity_bytes=4 * GIB,
        used_bytes=2 * GIB,
        chunks=1024,
        lookups=300,
        hits=200,
        written_bytes=12 * GIB,
        read_bytes=GIB + (512 << 20),
        promotions=17,
        evictions=4,
        dropped_dirty=3,
        dropped_backpressure=1,
        queued=5,
    ),
    fs=dict(capacity_bytes=0, used_bytes=GIB, lookups=50, hits=0, written_bytes=GIB),
)


def test_rates_are_differences_over_the_interval():
    frame = top.build_frame("/s", top.Sample(12.0, AFTER), top.Sample(10.0, BEFORE))
    assert frame.interval_s == 2.0 and (frame.sessions, frame.leases, frame.namespaces) == (2, 3, 4)
    ram, fs = frame.tiers
    assert (ram.name, ram.kind, fs.kind) == ("ram", "ram", "fs")
    assert ram.utilization == 0.5 and ram.chunks == 1024 and ram.queued == 5
    assert ram.hit_rate == 150 / 200 and ram.hit_rate_total == 200 / 300
    assert ram.lookups_per_s == 100 and ram.in_bytes_per_s == GIB and ram.out_bytes_per_s == 256 << 20
    assert ram.promotions_per_s == 5 and ram.evictions_per_s == 2
    assert ram.drops == 4 and ram.drops_per_s == 1.5  # dirty 1 -> 3, backpressure 0 -> 1
    # nothing looked up in the interval: no hit rate for it (not 0%); an unbounded tier: no utilization
    assert fs.hit_rate is None and fs.hit_rate_total == 0 and fs.utilization is None
    assert fs.lookups_per_s == 0 and fs.in_bytes_per_s == 0


def test_first_frame_restart_and_new_tier_have_no_rates():
    first = top.build_frame("/s", top.Sample(1.0, BEFORE), None)
    assert first.interval_s is None
    assert all(t.lookups_per_s is None and t.hit_rate is None for t in first.tiers)
    assert first.tiers[0].hit_rate_total == 0.5  # the totals are there from the start

    restarted = top.build_frame("/s", top.Sample(3.0, BEFORE), top.Sample(1.0, AFTER))
    ram, fs = restarted.tiers
    assert ram.in_bytes_per_s is None and ram.hit_rate is None and fs.in_bytes_per_s == 0  # fs did not go back

    grown = pb.StatsResponse()
    grown.CopyFrom(AFTER)
    grown.tiers[0].lookups += 100
    grown.tiers.add(name="s3", kind=pb.TIER_KIND_S3, lookups=9)
    frame = top.build_frame("/s", top.Sample(3.0, grown), top.Sample(1.0, AFTER))
    assert frame.tiers[2].name == "s3" and frame.tiers[2].lookups_per_s is None
    assert frame.tiers[0].lookups_per_s == 50


def test_rendered_rows_split_into_columns():
    frame = top.build_frame("/run/kvstored/kvstored.sock", top.Sample(12.0, AFTER), top.Sample(10.0, BEFORE))
    lines = top.render(frame, clock="12:00:00")
    assert lines[0].startswith("kvstored 9.9 on /run/kvstored/kvstored.sock  12:00:00  (rates over 2.0s")
    assert lines[1].split() == ["sessions", "2", "leases", "3", "reservations", "1", "regions", "1", "namespaces", "4"]
    header = lines[3].split()
    assert header == list(top.COLUMNS)
    rows = {line.split()[0]: dict(zip(header, line.split())) for line in lines[4:]}
    assert set(rows) == {"ram", "fs"} and all(len(r) == len(header) for r in rows.values())
    ram, fs = rows["ram"], rows["fs"]
    assert (ram["USED"], ram["CAP"], ram["UTIL"], ram["HIT%"], ram["HIT%ALL"]) == (
        "2.0G",
        "4.0G",
        "50.0%",
        "75.0%",
        "66.7%",
    )
    assert (ram["IN/s"], ram["OUT/s"], ram["LOOKUP/s"], ram["QUEUE"]) == ("1.0G", "256.0M", "100", "5")
    assert (ram["DROP/s"], ram["PROMO/s"], ram["EVICT/s"]) == ("1.5", "5.0", "2.0")
    assert (fs["CAP"], fs["UTIL"], fs["HIT%"], fs["IN/s"]) == ("inf", "-", "-", "0")


def test_a_narrow_terminal_sheds_the_least_needed_columns():
    frame = top.build_frame("/s", top.Sample(12.0, AFTER), top.Sample(10.0, BEFORE))
    wide = top.render(frame, clock="12:00:00")
    assert max(len(line) for line in wide[3:]) > 80  # the full table does not fit 80 columns
    for width in (80, 60):
        lines = top.render(frame, clock="12:00:00", width=width)
        table = lines[3:]
        assert all(len(line) <= width for line in table), (width, table)
        header = table[0].split()
        assert {"TIER", "USED", "HIT%", "IN/s", "OUT/s", "DROP/s"} <= set(header)
        assert header == [c for c in top.COLUMNS if c in header]  # order kept
        shed = [c for c in top.COLUMNS if c not in header]
        assert shed and set(shed) == set(top.SHED_ORDER[: len(shed)])  # shed in SHED_ORDER's order
        rows = {line.split()[0]: dict(zip(header, line.split())) for line in table[1:]}
        assert rows["ram"]["IN/s"] == "1.0G" and rows["ram"]["DROP/s"] == "1.5"  # cells stay under their column
    assert top.render(frame, clock="12:00:00", width=1000) == wide


def test_json_shape():
    frame = top.build_frame("/s", top.Sample(12.0, AFTER), top.Sample(10.0, BEFORE), error=None)
    d = top.frame_dict(frame)
    assert d["socket"] == "/s" and d["interval_s"] == 2.0 and d["error"] is None
    assert d["tiers"][0]["in_bytes_per_s"] == GIB and d["tiers"][1]["name"] == "fs"


def test_compact_sizes():
    assert [top.compact_size(n) for n in (0, 1, 1023, 1024, 1536, 5 << 20, 3 << 30, 2 << 40)] == [
        "0",
        "1B",
        "1023B",
        "1.0K",
        "1.5K",
        "5.0M",
        "3.0G",
        "2.0T",
    ]
