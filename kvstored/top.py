# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""`kvstoredctl top`: a live view of a daemon's tiers, from its Stats RPC alone.

Rates are differences between two Stats answers divided by the time between them; a frame is
pure data (`build_frame`), `render` turns it into lines of text, and `run_live` draws them with
curses until q or Ctrl-C.
"""

from __future__ import annotations

import curses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb

# Counters shown as rates (per second): (column, TierStats field, bytes?)
RATES = (
    ("lookups", "lookups", False),
    ("in_bytes", "written_bytes", True),
    ("out_bytes", "read_bytes", True),
    ("promotions", "promotions", False),
    ("evictions", "evictions", False),
    ("drops", None, False),  # the sum of every drop counter (see drops())
    # below RAM: hits not reported and write-downs not done, as slower than recomputing
    ("slow_hits", "skipped_slow_hits", False),
    ("slow_writes", "skipped_slow_writedowns", False),
)


def drops(t: pb.TierStats) -> int:
    """Chunks a tier refused or lost: backpressure, admission, disk full, errors, dirty evictions."""
    return t.dropped_backpressure + t.rejected_admission + t.rejected_full + t.errors + t.dropped_dirty


def _counter(t: pb.TierStats, field: str | None) -> int:
    return drops(t) if field is None else getattr(t, field)


def kind_name(kind: int) -> str:
    return pb.TierKind.Name(kind).removeprefix("TIER_KIND_").lower()


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic() when the answer came
    stats: pb.StatsResponse


@dataclass(frozen=True)
class TierRow:
    name: str
    kind: str
    used_bytes: int
    capacity_bytes: int  # 0: unbounded
    utilization: float | None
    chunks: int
    queued: int  # operations waiting in the tier's queue now
    hit_rate: float | None  # over the interval; None when nothing was looked up in it
    hit_rate_total: float | None  # since the daemon started
    lookups: int
    hits: int
    drops: int
    promotions: int
    # per second over the interval; None on the first frame, or after the counters went back (a restart)
    lookups_per_s: float | None
    in_bytes_per_s: float | None
    out_bytes_per_s: float | None
    promotions_per_s: float | None
    evictions_per_s: float | None
    drops_per_s: float | None
    slow_hits_per_s: float | None
    slow_writes_per_s: float | None
    load_bytes_per_s: float  # the tier's measured load throughput (0: not yet, and RAM)


@dataclass(frozen=True)
class Frame:
    socket: str
    version: str
    sessions: int
    leases: int
    reservations: int
    regions: int
    namespaces: int
    interval_s: float | None  # seconds between the two Stats answers the rates come from
    tiers: tuple[TierRow, ...]
    error: str | None = None  # the last Stats call failed (the figures are the last ones known)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _row(t: pb.TierStats, before: pb.TierStats | None, dt: float | None) -> TierRow:
    rates: dict[str, float | None] = {}
    # counters that went back: the daemon restarted between the two answers
    prev = (
        before
        if (
            before is not None
            and dt is not None
            and dt > 0
            and t.hits >= before.hits
            and all(_counter(t, field) >= _counter(before, field) for _, field, _ in RATES)
        )
        else None
    )
    for column, field, _ in RATES:
        rates[f"{column}_per_s"] = (_counter(t, field) - _counter(prev, field)) / dt if prev and dt else None
    interval_hit = _ratio(t.hits - prev.hits, t.lookups - prev.lookups) if prev else None
    return TierRow(
        name=t.name,
        kind=kind_name(t.kind),
        used_bytes=t.used_bytes,
        capacity_bytes=t.capacity_bytes,
        utilization=_ratio(t.used_bytes, t.capacity_bytes),
        chunks=t.chunks,
        queued=t.queued,
        hit_rate=interval_hit,
        hit_rate_total=_ratio(t.hits, t.lookups),
        lookups=t.lookups,
        hits=t.hits,
        drops=drops(t),
        promotions=t.promotions,
        load_bytes_per_s=t.load_bytes_per_s,
        **rates,
    )


def build_frame(socket: str, current: Sample, previous: Sample | None, error: str | None = None) -> Frame:
    """The view of `current`, with rates from `previous` (tiers are matched by name)."""
    s = current.stats
    before = {t.name: t for t in previous.stats.tiers} if previous else {}
    dt = current.at - previous.at if previous else None
    return Frame(
        socket=socket,
        version=s.version,
        sessions=s.sessions,
        leases=s.leases,
        reservations=s.reservations,
        regions=s.regions,
        namespaces=s.namespaces,
        interval_s=dt,
        tiers=tuple(_row(t, before.get(t.name), dt) for t in s.tiers),
        error=error,
    )


def frame_dict(frame: Frame) -> dict[str, Any]:
    return asdict(frame) | {"tiers": [asdict(t) for t in frame.tiers]}


# -- text ---------------------------------------------------------------------------------------


def compact_size(n: float) -> str:
    """Binary units, no space (columns split on whitespace): 0, 512B, 1.5K, 12.3M, 1.1G, 2.0T."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return "0" if n == 0 else f"{n:.0f}B"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _per_s(value: float | None, size: bool = False) -> str:
    if value is None:
        return "-"
    if size:
        return compact_size(value)
    return f"{value:.0f}" if value >= 10 or value == 0 else f"{value:.1f}"


COLUMNS = (
    "TIER",
    "KIND",
    "USED",
    "CAP",
    "UTIL",
    "CHUNKS",
    "HIT%",
    "HIT%ALL",
    "LOOKUP/s",
    "IN/s",
    "OUT/s",
    "QUEUE",
    "LOADRATE",  # below RAM: measured load throughput; then hits and write-downs skipped as slow
    "SLOWHIT/s",
    "SLOWWR/s",
    "DROP/s",
    "PROMO/s",
    "EVICT/s",
)
# Dropped first to last while the table is wider than the terminal (as top and htop do); TIER,
# USED, HIT%, IN/s, OUT/s and DROP/s always stay (52 columns with 8-character tier names).
SHED_ORDER = (
    "SLOWWR/s",
    "LOADRATE",
    "SLOWHIT/s",
    "HIT%ALL",
    "CAP",
    "PROMO/s",
    "EVICT/s",
    "CHUNKS",
    "QUEUE",
    "KIND",
    "LOOKUP/s",
    "UTIL",
)


def _cells(t: TierRow) -> list[str]:
    return [
        t.name,
        t.kind,
        compact_size(t.used_bytes),
        compact_size(t.capacity_bytes) if t.capacity_bytes else "inf",
        _pct(t.utilization),
        str(t.chunks),
        _pct(t.hit_rate),
        _pct(t.hit_rate_total),
        _per_s(t.lookups_per_s),
        _per_s(t.in_bytes_per_s, size=True),
        _per_s(t.out_bytes_per_s, size=True),
        str(t.queued),
        compact_size(t.load_bytes_per_s) if t.load_bytes_per_s else "-",
        _per_s(t.slow_hits_per_s),
        _per_s(t.slow_writes_per_s),
        _per_s(t.drops_per_s),
        _per_s(t.promotions_per_s),
        _per_s(t.evictions_per_s),
    ]


def render(frame: Frame, clock: str | None = None, width: int | None = None) -> list[str]:
    """The frame as lines: two header lines, a blank, the column header, one row per tier.
    Values never contain spaces, so a row splits into its columns on whitespace. With `width`,
    columns in SHED_ORDER are left out until the table fits."""
    stamp = clock or time.strftime("%H:%M:%S")
    every = "first sample" if frame.interval_s is None else f"rates over {frame.interval_s:.1f}s"
    lines = [
        f"kvstored {frame.version} on {frame.socket}  {stamp}  ({every}; q quits)",
        f"sessions {frame.sessions}  leases {frame.leases}  reservations {frame.reservations}  "
        f"regions {frame.regions}  namespaces {frame.namespaces}",
    ]
    if frame.error:
        lines.append(f"! {frame.error}")
    rows = [list(COLUMNS)] + [_cells(t) for t in frame.tiers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    shown = list(range(len(COLUMNS)))
    shed = [COLUMNS.index(name) for name in SHED_ORDER]
    while width is not None and shed and sum(widths[i] for i in shown) + 2 * (len(shown) - 1) > width:
        shown.remove(shed.pop(0))
    left_aligned = {COLUMNS.index("TIER"), COLUMNS.index("KIND")}
    table = [
        "  ".join(r[i].ljust(widths[i]) if i in left_aligned else r[i].rjust(widths[i]) for i in shown).rstrip()
        for r in rows
    ]
    return lines + [""] + table


# -- the live screen ----------------------------------------------------------------------------


class StatsSource:
    """Takes samples; keeps the last good one so a failed call still shows the last figures."""

    def __init__(self, socket: str, fetch: Callable[[], pb.StatsResponse], error_type: type[Exception]) -> None:
        self._socket = socket
        self._fetch = fetch
        self._error_type = error_type
        self._last: Sample | None = None

    def sample(self) -> Sample:
        return Sample(time.monotonic(), self._fetch())

    def next_frame(self) -> Frame | str:
        """A frame with rates since the previous call, or the error text while none is known."""
        try:
            current = self.sample()
        except self._error_type as exc:
            if self._last is None:
                return str(exc)
            return build_frame(self._socket, self._last, None, error=str(exc))
        previous, self._last = self._last, current
        return build_frame(self._socket, current, previous)


def _draw(screen: curses.window, lines: Sequence[str]) -> None:
    screen.erase()
    height, width = screen.getmaxyx()
    table_start = next((i for i, line in enumerate(lines) if line.startswith("TIER")), -1)
    for y, line in enumerate(lines[:height]):
        attr = curses.A_REVERSE if y == table_start else curses.A_NORMAL
        try:
            # the last column of the last line cannot be written without an error: stop one short
            screen.addnstr(y, 0, line.ljust(width) if y == table_start else line, max(width - 1, 0), attr)
        except curses.error:
            pass
    screen.refresh()


def _loop(screen: curses.window, source: StatsSource, interval_s: float) -> None:
    try:
        curses.curs_set(0)
    except curses.error:  # a terminal that cannot hide the cursor
        pass
    while True:
        frame = source.next_frame()
        lines = [frame] if isinstance(frame, str) else render(frame, width=screen.getmaxyx()[1] - 1)
        _draw(screen, lines)
        deadline = time.monotonic() + interval_s
        while (left := deadline - time.monotonic()) > 0:
            screen.timeout(max(1, int(left * 1000)))
            key = screen.getch()
            if key in (ord("q"), ord("Q")):
                return
            if key == curses.KEY_RESIZE:
                curses.update_lines_cols()
                _draw(screen, lines)


def run_live(source: StatsSource, interval_s: float) -> None:
    """Redraw every `interval_s` until q or Ctrl-C; the terminal is restored either way."""
    try:
        curses.wrapper(_loop, source, interval_s)
    except KeyboardInterrupt:
        pass
