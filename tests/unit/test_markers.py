# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The markers of what a test needs (tests/support/needs.py): one list in pyproject.toml, the
Makefile's test-fast and needs.py, and a test using radosgw, network namespaces, huge pages, vllm
or ucxx without its marker fails, naming it (run here in a pytest of its own)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support.needs import FAST_DESELECT, Needs

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_registers_every_need_and_the_makefile_deselects_them_all():
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":", 1)[0] for line in options["markers"]}
    assert registered == {"slow", *(n.value for n in Needs)}
    assert "--strict-markers" in options["addopts"]
    fast = re.search(r"^FAST_MARKERS := (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert fast and fast.group(1) == FAST_DESELECT


def run_pytest(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """`body` as a test module outside tests/, with tests/conftest.py's hooks and the project's
    pytest options."""
    (tmp_path / "test_unmarked.py").write_text(body)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-c",
            str(REPO / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_unmarked.py"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


HELPERS = """
import pytest

from tests.support import hugepages, netns, s3


def test_netns():
    with netns.topology_or_fail(2):
        pass


def test_radosgw():
    with s3.radosgw_or_fail():
        pass


def test_huge_pages():
    with hugepages.reserved_huge_pages(1):
        pass


@pytest.mark.netns
def test_netns_without_root():
    with netns.topology_or_fail(2):
        pass
"""


def test_helpers_fail_a_test_without_the_marker_of_what_they_bring_up(tmp_path):
    out = run_pytest(tmp_path, HELPERS)
    assert out.returncode == 1, out.stdout + out.stderr
    for test, marks in [
        ("test_netns", "pytest.mark.netns, pytest.mark.root"),
        ("test_radosgw", "pytest.mark.radosgw"),
        ("test_huge_pages", "pytest.mark.root"),
        ("test_netns_without_root", "pytest.mark.root"),
    ]:
        assert f"::{test} needs {marks}: add it" in out.stdout, out.stdout


# A module constant: the check reads test functions' source, and would find these lines in this test's.
IMPORTS = """
import pytest


def test_uses_vllm():
    from vllm.distributed.kv_events import BlockStored  # noqa: F401


@pytest.mark.ucxx
def test_uses_ucxx():
    import ucxx  # noqa: F401
"""


def test_a_test_importing_vllm_or_ucxx_without_the_marker_is_refused_at_collection(tmp_path):
    out = run_pytest(tmp_path, IMPORTS)
    assert out.returncode == 4, out.stdout + out.stderr  # a usage error: nothing ran
    assert "test_uses_vllm imports vllm (mark it vllm)" in out.stderr
    assert "test_uses_ucxx" not in out.stderr


INDIRECT = """
import importlib


def test_imports_vllm_through_a_helper():
    importlib.import_module("vllm")
"""


def test_a_test_that_first_imports_vllm_unmarked_errors(tmp_path):
    """The import the source check cannot see (through a helper), of a stand-in vllm package
    beside the test module (first on sys.path there), so it runs where vllm is not installed."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    out = run_pytest(tmp_path, INDIRECT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed, 1 error" in out.stdout, out.stdout
    assert "::test_imports_vllm_through_a_helper imported vllm: mark it vllm" in out.stdout, out.stdout
