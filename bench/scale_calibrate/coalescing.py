# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The coalescing phase: B following A's events each as it happens, then coalesced (A's net
changes once per its events_interval), under the fleet model's workload: a turn's store of
`batch` chunks, `turn_rate` turns a second, with A's RAM and fs full so that every store writes
down and evicts (one key per event). What following A costs B per turn, and what one more
follower costs A (its CPU with `subscribers` more streams minus without, per stream)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.scale_calibrate.common import LIFE_CHUNK, new_keys, ns_fields, storing
from bench.scale_calibrate.daemons import Pair, Phase
from bench.scale_calibrate.subscribers import Subscribers

EVENTS_INTERVAL_S = 0.1  # A's events_interval (the daemon's default)


@dataclass(frozen=True)
class FollowMode:
    coalesced: bool
    turns: int
    seconds: float  # the paced stores, B catching up included
    bus_events: int  # what A published (its bus: the uncoalesced watcher's count)
    bus_keys: int
    messages: int  # what B applied
    follower_cpu_s: float  # B's
    publisher_cpu_s_per_subscriber: float  # A's, per extra stream
    subscribers: int  # the extra streams

    @property
    def follower_s_per_turn(self) -> float:
        return self.follower_cpu_s / self.turns

    @property
    def publisher_s_per_turn(self) -> float:
        return self.publisher_cpu_s_per_subscriber / self.turns


def measure_coalescing(
    pair: Pair, batch: int, turns: int, turn_rate: float, subscribers: int, coalesced_subscribers: int
) -> dict[str, Any]:
    """subscribers, coalesced_subscribers: the extra streams of each mode (a coalesced stream
    costs A so little that 16 of them are within the noise of A's own stores)."""
    data = np.zeros((batch, LIFE_CHUNK), np.uint8)
    modes: list[FollowMode] = []
    print(f"coalescing: {turns} turns of {batch} chunks at {turn_rate:g}/s, RAM and fs full", flush=True)
    with pair.a.client() as kv:
        ns = kv.register_namespace(**ns_fields("life", LIFE_CHUNK))  # the lifecycle phase's: full

        def paced(tag: str) -> Callable[[], int]:  # a mode's turns
            return storing(kv, ns, new_keys(turns * batch, tag), batch, data, turn_rate)

        def nudger(keys: Iterator[bytes]) -> Callable[[], None]:
            def nudge() -> None:
                kv.store(ns, [next(keys)], data[:1])

            return nudge

        for coalesce, crowd_size in ((False, subscribers), (True, coalesced_subscribers)):
            name = "coalesced" if coalesce else "each event"
            pair.follow(coalesce)
            pair.measure_idle()
            alone = pair.phase(f"turns, B following {name}", paced(f"c{coalesce:d}-1"))
            subs = Subscribers(pair.a.address, crowd_size, coalesce)
            try:
                subs.wait_ready(nudger(iter(new_keys(200, f"c{coalesce:d}-n"))))
                crowd = pair.phase(f"turns, {crowd_size} more followers {name}", paced(f"c{coalesce:d}-2"))
            finally:
                subs.stop()
            modes.append(_mode(coalesce, turns, alone, crowd, crowd_size))
    each, coalesced = modes
    return {
        "basis": f"{turns} stores of {batch} chunks of {LIFE_CHUNK >> 10} KiB at {turn_rate:g}/s on A (RAM and fs "
        "full: each store writes down and evicts), B following A each event as it happens, then coalesced "
        f"(A's events_interval {EVENTS_INTERVAL_S:g} s); B's CPU, idle and polls subtracted; A's CPU with "
        f"{subscribers} more followers each event, {coalesced_subscribers} coalesced (a child process) minus "
        "without, per follower",
        "turn_rate": turn_rate,
        "modes": [{**asdict(m), "follower_s_per_turn": m.follower_s_per_turn} for m in modes],
        "follower_ratio": _ratio(each.follower_s_per_turn, coalesced.follower_s_per_turn),
        "publisher_ratio": _ratio(each.publisher_s_per_turn, coalesced.publisher_s_per_turn),
        "messages_ratio": _ratio(each.messages, coalesced.messages),
        "coalesced_messages_per_interval": coalesced.messages / max(1.0, coalesced.seconds / EVENTS_INTERVAL_S),
    }


def _mode(coalesce: bool, turns: int, alone: Phase, crowd: Phase, subscribers: int) -> FollowMode:
    return FollowMode(
        coalesce,
        turns,
        alone.seconds,
        sum(v for k, v in alone.by_kind.items() if not k.endswith(" keys")),
        alone.keys,
        alone.events,
        alone.b_cpu_s,
        max(0.0, crowd.a_cpu_s - alone.a_cpu_s) / subscribers,
        subscribers,
    )


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def coalescing_lines(doc: dict[str, Any]) -> list[tuple[str, str]]:
    each, coalesced = doc["modes"]
    rate = doc["turn_rate"]

    def times(r: float | None) -> str:
        return f"{r:.0f}x" if r is not None else "(coalesced below the noise)"

    lines = [
        (
            "following A at the model's turn rate",
            f"each event {each['follower_s_per_turn'] * rate:.1%} of a core ({each['messages']} messages), "
            f"coalesced {coalesced['follower_s_per_turn'] * rate:.2%} ({coalesced['messages']}): "
            f"{times(doc['follower_ratio'])} less",
        ),
        (
            "publishing to one more follower",
            f"each event {each['publisher_cpu_s_per_subscriber'] / each['turns'] * rate:.1%} of a core, coalesced "
            f"{coalesced['publisher_cpu_s_per_subscriber'] / coalesced['turns'] * rate:.2%}: "
            f"{times(doc['publisher_ratio'])} less",
        ),
    ]
    floor = doc.get("grpc_floor")
    if floor:
        lines.append(
            (
                "gRPC's floor per message (no daemon)",
                f"receiving {floor['receiver_s_per_message'] * 1e6:.0f} us, sending "
                f"{floor['sender_s_per_message'] * 1e6:.0f} us per {floor['payload_bytes']:,} B message after a "
                f"quiet interval: {floor['receiver_s_per_message'] * rate:.2%} of a core at {rate:g}/s; the "
                f"coalesced follower's {coalesced['follower_cpu_s'] / max(1, coalesced['messages']) * 1e6:.0f} us "
                "per message",
            )
        )
    return lines
