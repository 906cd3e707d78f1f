# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""DropLog: chunks a client dropped, one WARNING per reason per interval, each line carrying the
count since that reason's previous one."""

from __future__ import annotations

import logging

from kvstored_client.droplog import DropLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_one_line_per_reason_per_interval_with_the_count_since_the_last(caplog):
    clock = Clock()
    drops = DropLog("kvstored at /s", interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvstored_client"):
        assert drops.record("unavailable", 16, "no answer within 2 s")
        assert not any(drops.record("unavailable", 4, "no answer within 2 s") for _ in range(5))
        assert drops.record("ram_full", 2, "the daemon's reason")  # reasons are limited apart
        clock.now += 12.0
        assert drops.record("unavailable", 1, "no answer within 2 s")
        assert not drops.record("unavailable", 0, "nothing dropped")  # no chunk, no line
    assert lines(caplog) == [
        "kvstored at /s: stores dropped 16 chunk(s) (unavailable): no answer within 2 s",
        "kvstored at /s: stores dropped 2 chunk(s) (ram_full): the daemon's reason",
        "kvstored at /s: stores dropped 21 chunk(s) in 12 s (unavailable): no answer within 2 s",
    ]
