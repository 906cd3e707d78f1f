# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The key index's hash table (kvstored_client/_keyindex.c): adds and removes in any order leave
exactly the keys added and not removed, probes stay exact at its highest load, a table mapped
read-only is probed as is, and what is not a table is refused."""

from __future__ import annotations

import mmap
import os
import random

import pytest

from kvstored.shm.keyindex import KeyIndex
from kvstored_client import _keyindex
from kvstored_client.keyindex import TOUCH_DELAY_S, KeyIndexView, Touches, open_view


def test_adds_and_removes_in_any_order_leave_exactly_the_keys_held():
    slots = 1024
    table = bytearray(_keyindex.size(32, slots))
    _keyindex.init(table, 32, slots)
    rnd = random.Random(23)
    keys = [rnd.randbytes(32) for _ in range(900)]
    held: set[bytes] = set()
    for step in range(60_000):
        key = rnd.choice(keys)
        if rnd.random() < 0.5:
            added = _keyindex.add(table, key)
            if len(held) * 4 < slots * 3:  # (refused beyond 3/4 full: probes must end somewhere)
                assert added == (key not in held), step
            if added:
                held.add(key)
        else:
            assert _keyindex.remove(table, key) == (key in held), step
            held.discard(key)
        if step % 997 == 0:
            assert _keyindex.probe(table, keys) == bytes(k in held for k in keys), step
            assert _keyindex.entries(table) == len(held)
    ordered = sorted(held)
    assert _keyindex.leading(table, ordered) == len(ordered)
    assert _keyindex.leading(table, [*ordered[:3], rnd.randbytes(32), *ordered[3:]]) == 3


def test_keys_of_another_length_are_never_held_and_never_added():
    table = bytearray(_keyindex.size(36, 16))
    _keyindex.init(table, 36, 16)
    assert _keyindex.add(table, b"k" * 36)
    assert _keyindex.probe(table, [b"k" * 36, b"k" * 32, b""]) == b"\x01\x00\x00"
    with pytest.raises(ValueError, match="36-byte keys"):
        _keyindex.add(table, b"k" * 32)


def test_a_daemons_table_is_read_through_a_read_only_descriptor():
    index = KeyIndex("ns", 32, max_chunks=100)
    try:
        index.add(b"a" * 32)
        view = KeyIndexView(index.read_only_fd(), index.size, 32)
        assert view.holds([b"a" * 32, b"b" * 32]) == [True, False]
        index.add(b"b" * 32)
        index.remove(b"a" * 32)
        assert view.holds([b"a" * 32, b"b" * 32]) == [False, True]  # the same memory, kept up to date
        fd = index.read_only_fd()
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, index.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view.close()
    finally:
        index.close()


def test_what_is_not_a_table_is_refused():
    with pytest.raises(ValueError, match="not a key index"):
        _keyindex.probe(bytearray(4096), [b"k" * 32])
    with pytest.raises(ValueError, match="power of two"):
        _keyindex.init(bytearray(4096), 32, 100)


def test_an_index_the_client_cannot_read_is_none_and_its_lookups_ask_the_daemon(tmp_path, caplog):
    """A mapping whose header is not a key index (a daemon of another version): no error for the
    caller, a warning, and the descriptor closed."""
    path = tmp_path / "not-an-index"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    assert open_view("ns", fd, 4096, 32) is None
    with pytest.raises(OSError):
        os.fstat(fd)  # (taken and closed)
    assert "key index of namespace ns not usable" in caplog.text


def test_touches_name_each_key_once_and_carry_every_lookup_within_a_request_size():
    touches = Touches()
    keys = [bytes([i]) * 32 for i in range(5)]
    touches.add("ns-a", keys[:3], 0.0)
    touches.add("ns-a", keys[1:5], 0.0)  # keys 1 and 2 asked again
    touches.add("ns-b", keys[:1], 0.0)
    assert touches and not touches.due(0.0)  # (neither enough keys nor old enough yet)
    assert touches.due(TOUCH_DELAY_S)
    parts = list(touches.take(per_request=2))
    assert not touches
    assert (
        parts
        == [
            ("ns-a", keys[0:2], 4),  # the first part carries the 2 repeats: 7 lookups in all
            ("ns-a", keys[2:4], 2),
            ("ns-a", keys[4:5], 1),
            ("ns-b", keys[:1], 1),
        ]
    )
    assert sum(n for ns, _, n in parts if ns == "ns-a") == 7
