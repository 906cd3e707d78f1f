# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Log setup: text for people, JSON lines for collectors; a limiter for lines a client can cause."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstored.config import LogFormat, LogLevel


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup_logging(level: LogLevel, fmt: LogFormat) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@dataclass(slots=True)
class _Window:
    opened_at: float
    suppressed: int = 0


class LogLimiter:
    """At most one line per kind of event per `interval_s`: what a client can trigger at will
    (garbage requests, a bug it found) must not flood the log. The first line after a quiet
    spell says how many were suppressed before it. Kinds must come from a bounded set (method
    names, not request values)."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def log(self, kind: str, level: int, msg: str, *args: Any, exc_info: BaseException | None = None) -> bool:
        """Log unless `kind` was logged within the interval; True if a line was written."""
        now = self._clock()
        window = self._windows.get(kind)
        if window is not None and now - window.opened_at < self.interval_s:
            window.suppressed += 1
            return False
        self._windows[kind] = _Window(now)
        if window is not None and window.suppressed:
            msg += " (%d more like it suppressed since the last such line)"
            args = (*args, window.suppressed)
        self._logger.log(level, msg, *args, exc_info=exc_info)
        return True
