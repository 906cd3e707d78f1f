# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What a system's start function returns to the coordinator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Server:
    """The server side of one system: its processes (for CPU accounting), the config its client
    processes get, the python that runs them (None: the project's), a line for the report."""

    pids: Callable[[], list[int]]
    config: dict[str, Any]
    describe: str
    stop: Callable[[], Any] = lambda: None
    python: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
