# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What a test needs beyond the venv, as pytest markers (registered in pyproject.toml), so that
`make test-fast` can leave those tests out on a contributor's laptop.

Helpers that bring up such a thing (radosgw, network namespaces, huge pages) call `require`: a
test that uses one without its marker fails at once, naming the marker, instead of failing later
under `make test-fast` where nobody looks for the missing marker. tests/conftest.py tells this
module which test is running.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import pytest


class Needs(enum.Enum):
    ROOT = "root"
    RADOSGW = "radosgw"
    UCXX = "ucxx"
    VLLM = "vllm"
    NETNS = "netns"
    SYSTEM_DEPS = "system_deps"


# What `make test-fast` deselects (the Makefile spells it out too; test_markers checks they agree).
FAST_DESELECT = "not (" + " or ".join(n.value for n in Needs) + ")"

_running: pytest.Item | None = None


@contextlib.contextmanager
def running(item: pytest.Item) -> Iterator[None]:
    """`item` is the running test for the block (its setup, call and teardown)."""
    global _running
    _running = item
    try:
        yield
    finally:
        _running = None


def missing(item: pytest.Item, *needs: Needs) -> list[str]:
    """The markers among `needs` that `item` lacks (its own, its class's, module's or parameter's)."""
    return [n.value for n in needs if item.get_closest_marker(n.value) is None]


def require(*needs: Needs) -> None:
    """Fail the running test unless it carries the markers of `needs`. Outside a test run (a
    benchmark reusing a helper) there is nothing to check."""
    if _running is None:
        return
    absent = missing(_running, *needs)
    if absent:
        marks = ", ".join(f"pytest.mark.{name}" for name in absent)
        pytest.fail(
            f"{_running.nodeid} needs {marks}: add it to the test (or the module's pytestmark), "
            "so that `make test-fast` leaves the test out where that is not available",
            pytrace=False,
        )
