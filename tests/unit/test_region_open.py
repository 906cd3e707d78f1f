# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Opening region files named by path: beneath an allowed directory, no symlinks on the way,
regular files only, never blocking (kvstored.shm.beneath, kvstored.shm.mapping.open_region_file).

Both implementations run: openat2 (this kernel has it) and the openat walk used where it is
missing (ENOSYS)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest

from kvstored.errors import InvalidRequest, RegionFileMissing, RegionNotAllowed
from kvstored.shm import beneath
from kvstored.shm.mapping import open_region_file
from tests.support.daemon import REPO_ROOT

IMPLEMENTATIONS = pytest.mark.parametrize("use_openat2", [True, False], ids=["openat2", "openat-walk"])


@pytest.fixture
def tree(tmp_path):
    """allowed/{f, sub/g, link-in -> f, link-out -> ../outside/secret, dirlink -> ../outside}"""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "f").write_bytes(b"f" * 4096)
    (allowed / "sub" / "g").write_bytes(b"g" * 8192)
    (outside / "secret").write_bytes(b"s" * 100)
    (allowed / "link-in").symlink_to("f")
    (allowed / "link-out").symlink_to(outside / "secret")
    (allowed / "dirlink").symlink_to(outside)
    return allowed


@pytest.fixture
def dir_fd(tree):
    fd = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    yield fd
    os.close(fd)


@pytest.fixture
def walk_only(monkeypatch):
    """The daemon on a kernel without openat2."""
    monkeypatch.setattr(beneath, "_openat2_works", False)


def test_openat2_is_available_here(dir_fd):
    assert beneath.openat2_supported(dir_fd)  # else only the walk would be tested below


@IMPLEMENTATIONS
@pytest.mark.parametrize("relpath, size", [("f", 4096), ("sub/g", 8192), ("./sub//g", 8192)])
def test_opens_regular_files_beneath(dir_fd, use_openat2, relpath, size):
    fd = beneath.open_beneath(dir_fd, relpath, os.O_RDONLY, use_openat2=use_openat2)
    try:
        assert os.fstat(fd).st_size == size
        assert os.get_inheritable(fd) is False  # O_CLOEXEC
    finally:
        os.close(fd)


@IMPLEMENTATIONS
@pytest.mark.parametrize(
    "relpath, code",
    [
        ("link-in", errno.ELOOP),  # even a symlink that stays inside
        ("link-out", errno.ELOOP),
        ("dirlink/secret", errno.ELOOP),
        ("../outside/secret", errno.EXDEV),
        ("sub/../../outside/secret", errno.EXDEV),
        ("/etc/passwd", errno.EXDEV),
        ("nope", errno.ENOENT),
        ("f/x", errno.ENOTDIR),
    ],
)
def test_refuses_escapes_and_symlinks(dir_fd, use_openat2, relpath, code):
    with pytest.raises(OSError) as err:
        os.close(beneath.open_beneath(dir_fd, relpath, os.O_RDONLY, use_openat2=use_openat2))
    assert err.value.errno == code


# -- open_region_file ----------------------------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["openat2", "openat-walk"])
def impl(request, monkeypatch):
    if not request.param:
        monkeypatch.setattr(beneath, "_openat2_works", False)
    return request.param


def _opened_size(path, allowed) -> int:
    fd = open_region_file(str(path), allowed)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def test_region_file_inside_opens_read_write(tree, impl):
    assert _opened_size(tree / "sub" / "g", [tree]) == 8192
    # a symlink that resolves inside names its target, as before
    assert _opened_size(tree / "link-in", [tree]) == 4096
    fd = open_region_file(str(tree / "f"), [tree])
    try:
        os.pwrite(fd, b"w", 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("name", ["link-out", "dirlink/secret", "sub/../../outside/secret"])
def test_region_file_outside_is_not_allowed(tree, impl, name):
    with pytest.raises(RegionNotAllowed, match="outside the allowed directories"):
        open_region_file(str(tree / name), [tree])
    assert (tree.parent / "outside" / "secret").read_bytes() == b"s" * 100


def test_region_file_missing_and_nul(tree, impl):
    with pytest.raises(RegionFileMissing, match="does not exist"):
        open_region_file(str(tree / "missing"), [tree])
    with pytest.raises(InvalidRequest, match="NUL"):
        open_region_file(str(tree / "f") + "\0x", [tree])


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "the allowed directory"])
def test_non_regular_region_files_are_refused_without_blocking(tree, impl, kind):
    path = tree / "odd"
    sock = None
    if kind == "fifo":
        os.mkfifo(path)  # opening it for reading alone would wait for a writer
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    elif kind == "directory":
        path.mkdir()
    else:
        path = tree
    try:
        with pytest.raises(InvalidRequest, match="not a regular file"):
            open_region_file(str(path), [tree])
    finally:
        if sock is not None:
            sock.close()


def test_second_allowed_directory(tree, tmp_path, impl):
    other = tmp_path / "other"
    other.mkdir()
    (other / "r").write_bytes(b"r" * 12288)
    assert _opened_size(other / "r", [tree, other]) == 12288


def test_walk_without_openat2_never_opens_through_a_swapped_symlink(tmp_path, walk_only):
    """The fallback against the same race as tests/faults/test_region_open_race.py, in-process:
    allowed/sub swaps places with a symlink to a directory outside thousands of times while
    the file beneath it is opened; the opened inode (told by its size) is never the outside one."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "sub" / "f").write_bytes(b"i" * 100)
    (outside / "f").write_bytes(b"o" * 200)
    (allowed / "alt").symlink_to(outside)
    swapper = subprocess.Popen(
        [sys.executable, "-m", "tests.support.swap", str(allowed / "sub"), str(allowed / "alt")],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    outcomes: Counter[str] = Counter()
    try:
        assert swapper.stdout.readline().strip() == "ready"
        for _ in range(3000):
            try:
                outcomes[{100: "inside", 200: "outside"}[_opened_size(allowed / "sub" / "f", [allowed])]] += 1
            except RegionNotAllowed:
                outcomes["refused"] += 1
    finally:
        swapper.stdin.close()
        swapper.stdout.read()
        swapper.wait()
    assert outcomes["outside"] == 0, dict(outcomes)
    assert outcomes["inside"] > 0 and outcomes["refused"] > 0, dict(outcomes)
