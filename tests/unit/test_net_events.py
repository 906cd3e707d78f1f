# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""coalesce.net_events: one interval of bus events as the net changes a follower applies."""

from __future__ import annotations

from kvstored.chunks.ids import TierKind
from kvstored.events.bus import MAX_EVENT_KEYS, Cause, EventType, KvEvent
from kvstored.events.coalesce import net_events

NS = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


def _events(*specs: tuple[EventType, Cause, str, list[bytes]], ns: str = NS) -> list[KvEvent]:
    kinds = {"ram": TierKind.RAM, "fs": TierKind.FS}
    return [
        KvEvent(seq, 1000.0 + seq, type_, cause, tier, kinds[tier], ns, tuple(keys))
        for seq, (type_, cause, tier, keys) in enumerate(specs, start=1)
    ]


def _by_group(events: list[KvEvent]) -> dict[tuple[EventType, Cause, str], list[bytes]]:
    out: dict[tuple[EventType, Cause, str], list[bytes]] = {}
    for e in events:
        out.setdefault((e.type, e.cause, e.tier), []).extend(e.keys)
    return out


def test_one_key_per_event_becomes_one_event_per_kind_with_each_chunks_last_change():
    a, b, c, d = b"a", b"b", b"c", b"d"
    events = _events(
        (EventType.STORED, Cause.STORED, "ram", [a]),
        (EventType.STORED, Cause.STORED, "ram", [b]),
        (EventType.STORED, Cause.WRITTEN_DOWN, "fs", [a]),
        (EventType.REMOVED, Cause.EVICTED, "ram", [a]),
        (EventType.STORED, Cause.STORED, "ram", [c]),
        (EventType.REMOVED, Cause.EVICTED, "ram", [c]),  # stored and evicted in the interval
        (EventType.REMOVED, Cause.EVICTED, "ram", [d]),
        (EventType.STORED, Cause.PROMOTED, "ram", [d]),  # evicted and promoted back
    )
    net = net_events(events)
    assert _by_group(net) == {
        (EventType.STORED, Cause.STORED, "ram"): [b],
        (EventType.STORED, Cause.WRITTEN_DOWN, "fs"): [a],
        (EventType.REMOVED, Cause.EVICTED, "ram"): [a, c],
        (EventType.STORED, Cause.PROMOTED, "ram"): [d],
    }
    # every event says the interval's end, so a follower resumes after all of it
    assert {(e.seq, e.ts) for e in net} == {(8, 1008.0)}
    assert all(e.namespace_id == NS for e in net)
    assert {e.tier: e.tier_kind for e in net} == {"ram": TierKind.RAM, "fs": TierKind.FS}


def test_chunks_keep_the_order_they_were_first_touched_in():
    keys = [bytes([i]) for i in range(10)]
    events = _events(*[(EventType.STORED, Cause.STORED, "ram", [k]) for k in keys])
    events += _events((EventType.STORED, Cause.STORED, "ram", keys[:3]))  # touched again, later
    (only,) = net_events(events)
    assert list(only.keys) == keys  # a prefix comes out parent first


def test_namespaces_stay_apart_and_a_big_interval_is_split_at_the_bus_limit():
    many = [i.to_bytes(4, "big") for i in range(MAX_EVENT_KEYS + 5)]
    events = _events((EventType.STORED, Cause.STORED, "ram", many))
    events += _events((EventType.STORED, Cause.STORED, "ram", [b"x"]), ns=OTHER)
    net = net_events(events)
    assert [(e.namespace_id, len(e.keys)) for e in net] == [(NS, MAX_EVENT_KEYS), (NS, 5), (OTHER, 1)]
    assert [k for e in net[:2] for k in e.keys] == many


def test_a_cleared_namespace_stays_between_what_came_before_and_after_it():
    events = _events(
        (EventType.REMOVED, Cause.DELETED, "ram", [b"old"]),
        (EventType.CLEARED, Cause.DELETED, "ram", []),
        (EventType.STORED, Cause.STORED, "ram", [b"new"]),
    )
    net = net_events(events)
    assert [(e.type, e.keys) for e in net] == [
        (EventType.REMOVED, (b"old",)),
        (EventType.CLEARED, ()),
        (EventType.STORED, (b"new",)),
    ]


def test_no_events_no_changes():
    assert net_events([]) == []


def test_an_interval_is_one_message_unless_it_holds_more_keys_than_a_message_takes():
    from kvstored.server.watch import interval_messages

    small = _events(
        (EventType.STORED, Cause.STORED, "ram", [b"a"]),
        (EventType.STORED, Cause.WRITTEN_DOWN, "fs", [b"a"]),
    )
    (message,) = interval_messages(small)
    assert message.seq == 2 and not message.partial and not message.keys
    assert [(c.tier, list(c.keys), c.seq) for c in message.changes] == [("ram", [b"a"], 0), ("fs", [b"a"], 0)]
    many = [i.to_bytes(4, "big") for i in range(2 * MAX_EVENT_KEYS + 1)]
    big = _events((EventType.STORED, Cause.STORED, "ram", many), (EventType.REMOVED, Cause.EVICTED, "ram", [b"x"]))
    messages = interval_messages(big)
    assert [m.partial for m in messages] == [True, True, False] and {m.seq for m in messages} == {2}
    assert [k for m in messages for c in m.changes if c.type == EventType.STORED for k in c.keys] == many
    assert all(sum(len(c.keys) for c in m.changes) <= MAX_EVENT_KEYS for m in messages)
    assert interval_messages([]) == []
