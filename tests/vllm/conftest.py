# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""vLLM integration tests: real vllm==0.33.0 classes, real daemons, no mocks.

Without vLLM installed every test module here is left out and one test fails, saying how to
install it (nothing is skipped).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.daemon import Daemon, stop_all

INSTALL_HINT = "vllm==0.33.0 is not installed in this venv: run tests/vllm/install_vllm.sh"

try:
    import vllm.v1.kv_offload.tiering.manager  # noqa: F401  (the heaviest import the tests need)

    VLLM_ERROR = ""
except ImportError as exc:
    VLLM_ERROR = f"{INSTALL_HINT} ({exc})"

HERE = Path(__file__).parent
collect_ignore = [p.name for p in HERE.glob("test_*.py") if p.name != "test_vllm_installed.py"] if VLLM_ERROR else []


def _stop(daemons: list[Daemon]) -> None:
    errors = stop_all(daemons)
    if errors:
        pytest.fail("daemon teardown failed:\n" + "\n".join(errors), pytrace=False)


@pytest.fixture(scope="module")
def vllm_daemon():
    """One daemon per module, big enough for the small chunks these tests use."""
    d = Daemon(cpu_bytes="96MiB")
    d.start()
    yield d
    _stop([d])


@pytest.fixture
def own_daemon():
    """A factory of daemons private to one test (for tests that kill, stop or restart them)."""
    made: list[Daemon] = []

    def make(**kwargs) -> Daemon:
        d = Daemon(cpu_bytes=kwargs.pop("cpu_bytes", "64MiB"), **kwargs)
        made.append(d)
        return d

    yield make
    _stop(made)
