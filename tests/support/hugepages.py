# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Reserve 2 MiB hugetlb pages for a test (root only), giving them back afterwards."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstored.shm.memory import free_huge_pages
from tests.support.needs import Needs, require

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


@contextlib.contextmanager
def reserved_huge_pages(pages: int) -> Iterator[None]:
    """At least `pages` free huge pages for the block (vm.nr_hugepages raised, then restored)."""
    require(Needs.ROOT)
    if os.geteuid() != 0:
        pytest.fail("reserving huge pages (vm.nr_hugepages) needs root", pytrace=False)
    before = int(NR_HUGEPAGES.read_text())
    NR_HUGEPAGES.write_text(str(before + pages))
    try:
        if free_huge_pages(None) < pages:
            pytest.fail(f"the kernel gave fewer than {pages} huge pages (memory too fragmented?)", pytrace=False)
        yield
    finally:
        NR_HUGEPAGES.write_text(str(before))
