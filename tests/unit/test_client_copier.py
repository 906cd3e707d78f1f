# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The client's batch copier: how it splits a batch, and that it never leaves a copy running."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from kvstored_client import buffers
from kvstored_client.buffers import ChunkCopier, PoolArrays
from kvstored_client.copy_policy import MIN_PART_BYTES


class FakeExtent:
    def __init__(self, offset: int, length: int) -> None:
        self.offset, self.length = offset, length


def batch(n: int, chunk: int):
    src = np.random.default_rng(n).integers(0, 256, n * chunk, dtype=np.uint8)
    # chunk i goes to pool slot n-1-i, split in two extents
    pairs = [
        (
            [FakeExtent((n - 1 - i) * chunk, chunk // 2), FakeExtent((n - 1 - i) * chunk + chunk // 2, chunk // 2)],
            src[i * chunk : (i + 1) * chunk],
        )
        for i in range(n)
    ]
    return src, pairs


def test_small_batches_and_one_thread_stay_on_the_callers_thread():
    _, pairs = batch(4, 1 << 20)  # 4 MiB in all
    assert len(ChunkCopier(4)._split(pairs)) == 1
    _, big = batch(8, 4 << 20)
    assert len(ChunkCopier(1)._split(big)) == 1
    parts = ChunkCopier(4)._split(big)
    assert len(parts) == 4 and [p for part in parts for p in part] == big


@pytest.mark.parametrize("to_pool", [True, False])
def test_split_copies_are_exact_both_ways(to_pool):
    n, chunk = 8, MIN_PART_BYTES // 2
    src, pairs = batch(n, chunk)
    buffer = bytearray(n * chunk)
    pool = PoolArrays(buffer)
    copier = ChunkCopier(3)
    try:
        if to_pool:
            copier.copy(pool, pairs, to_pool=True)
            expected = src.reshape(n, chunk)[::-1].reshape(-1)
            np.testing.assert_array_equal(pool.numpy, expected)
        else:
            np.copyto(np.frombuffer(buffer, dtype=np.uint8), src)
            outs = [(ext, np.zeros(chunk, np.uint8)) for ext, _ in pairs]
            copier.copy(pool, outs, to_pool=False)
            for i, (_, out) in enumerate(outs):
                np.testing.assert_array_equal(out, src[(n - 1 - i) * chunk : (n - i) * chunk])
    finally:
        copier.close()


def test_an_error_is_raised_after_every_part_finished(monkeypatch):
    finished = []
    gate = threading.Event()

    n = 4

    def copy_in(pool, extents, view):
        if extents[0].offset == (n - 1) * MIN_PART_BYTES:  # the first chunk's part fails at once
            raise ValueError("bad chunk")
        gate.wait(5)
        finished.append(extents[0].offset)

    monkeypatch.setattr(buffers, "copy_in", copy_in)
    _, pairs = batch(n, MIN_PART_BYTES)
    copier = ChunkCopier(4)
    try:
        threading.Timer(0.05, gate.set).start()
        with pytest.raises(ValueError, match="bad chunk"):
            copier.copy(PoolArrays(bytearray(1)), pairs, to_pool=True)
        assert len(finished) == 3  # the failing part did not cut the others short
    finally:
        gate.set()
        copier.close()


@pytest.mark.parametrize("streaming", [True, False], ids=["helper", "numpy"])
@pytest.mark.parametrize(
    "size, dst_shift, src_shift",
    [
        (0, 0, 0),
        (7, 3, 1),
        (4096, 0, 0),
        (256 << 10, 0, 0),
        ((2 << 20) + 77, 5, 11),
        ((1 << 20) + 63, 1, 0),
    ],
)
def test_chunk_copies_are_exact_at_any_size_and_alignment(monkeypatch, streaming, size, dst_shift, src_shift):
    """The streaming helper aligns the destination, streams 64-byte blocks and copies the tail
    plainly: every byte lands, nothing outside the destination is touched. Without the helper
    (no C compiler) numpy copies the same bytes."""
    if streaming and not buffers.STREAMING:
        pytest.skip("kvstored_client._ntcopy is not built here")
    if not streaming:
        monkeypatch.setattr(buffers, "_stream_copy", None)
    rng = np.random.default_rng(size)
    src = rng.integers(0, 256, size + 64, dtype=np.uint8)
    dst = np.full(size + 64, 0xEE, dtype=np.uint8)
    buffers.copy_cpu(dst[dst_shift : dst_shift + size], src[src_shift : src_shift + size])
    np.testing.assert_array_equal(dst[dst_shift : dst_shift + size], src[src_shift : src_shift + size])
    assert (dst[:dst_shift] == 0xEE).all() and (dst[dst_shift + size :] == 0xEE).all()


def test_the_helper_refuses_buffers_of_different_sizes():
    if not buffers.STREAMING:
        pytest.skip("kvstored_client._ntcopy is not built here")
    with pytest.raises(ValueError):
        buffers.copy_cpu(np.zeros(10, np.uint8), np.zeros(11, np.uint8))


def test_the_client_copies_without_the_helper(tmp_path):
    """Built without a C compiler (no kvstored_client._ntcopy): the client imports and copies
    with numpy, and never imports the daemon."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['kvstored_client._ntcopy'] = None  # as if it was never built\n"
            "import numpy as np\n"
            "from kvstored_client import buffers\n"
            "assert not buffers.STREAMING\n"
            "src = np.arange(3 << 20, dtype=np.uint8); dst = np.zeros_like(src)\n"
            "buffers.copy_cpu(dst, src); assert (dst == src).all()\n"
            "assert not [m for m in sys.modules if m == 'kvstored' or m.startswith('kvstored.')]\n"
            "print('ok')",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert probe.returncode == 0 and probe.stdout.strip() == "ok", probe.stderr
