# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Polling for conditions that settle asynchronously (a daemon noticing a closed session...)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout: float = 30.0, poll_s: float = 0.02) -> bool:
    """True as soon as `cond()` is; False if it still is not after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return bool(cond())
