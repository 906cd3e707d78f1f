# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""LogLimiter: one line per kind per interval, the next one counting what was suppressed."""

from __future__ import annotations

import logging

from kvstored.logs import LogLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_kind_per_interval_with_the_suppressed_count(caplog):
    clock = Clock()
    limiter = LogLimiter(logging.getLogger("limited"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="limited"):
        assert limiter.log("a", logging.WARNING, "bad %s", "x")
        assert not any(limiter.log("a", logging.WARNING, "bad %s", "y") for _ in range(99))
        assert limiter.log("b", logging.WARNING, "other kind")  # kinds are limited apart
        clock.now += 10.0
        assert limiter.log("a", logging.WARNING, "bad %s", "z")
        clock.now += 10.0
        assert limiter.log("a", logging.WARNING, "bad %s", "w")
    assert [r.getMessage() for r in caplog.records] == [
        "bad x",
        "other kind",
        "bad z (99 more like it suppressed since the last such line)",
        "bad w",
    ]


def test_a_traceback_is_kept_on_the_lines_that_are_written(caplog):
    limiter = LogLimiter(logging.getLogger("limited"), interval_s=10.0, clock=Clock())
    error = ValueError("boom")
    with caplog.at_level(logging.INFO, logger="limited"):
        limiter.log("e", logging.ERROR, "internal error", exc_info=error)
        limiter.log("e", logging.ERROR, "internal error", exc_info=error)
    assert len(caplog.records) == 1 and caplog.records[0].exc_info[1] is error
