# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The direct spec's copy path on CPU tensors (standing in for the GPU KV cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstored_client.vllm.blockcopy import ChunkExtents, KVLayout, LayerRef, run_copies_cpu

PAGES = (256, 512)  # bytes per block of two KV-cache tensors
BPC = 4


def kv_layout(num_blocks: int = 32, seed: int = 0) -> KVLayout:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8, generator=gen) for p in PAGES]
    refs = [[LayerRef(0, PAGES[0]), LayerRef(1, PAGES[1]), LayerRef(1, PAGES[1])]]  # two layers share tensor 1
    return KVLayout(tensors, refs, BPC)


def test_part_layout_matches_vllm_cpu_tier():
    layout = kv_layout()
    assert layout.part_bytes == sum(PAGES) * BPC
    assert list(layout.tensor_offsets) == [0, PAGES[0] * BPC]


@pytest.mark.parametrize("extent_pages", [None, 1, 3])
def test_store_then_load_round_trips_through_split_extents(extent_pages):
    layout = kv_layout()
    part = layout.part_bytes
    num_chunks = 3
    pool = np.zeros(part * num_chunks * 2 + 4096, dtype=np.uint8)
    # Each chunk part in the pool: one extent, or runs of `extent_pages` 256-byte pages scattered backwards.
    per_chunk = []
    for c in range(num_chunks):
        base = 4096 + c * part * 2
        if extent_pages is None:
            per_chunk.append([(base, part)])
        else:
            run = extent_pages * 256
            starts = list(range(0, part, run))
            per_chunk.append([(base + part * 2 - (i + 1) * run, min(run, part - s)) for i, s in enumerate(starts)])
    extents = ChunkExtents.from_lists(per_chunk)
    blocks = np.array([5, 6, 7, 8, 20, 2, 3, 4, 11, 12, 13, 14])  # 3 chunks of 4 blocks
    store = layout.copies(blocks, [12], [0], extents, pool.ctypes.data, to_pool=True)
    run_copies_cpu(store)
    assert store.total_bytes == 12 * sum(PAGES)  # the shared tensor is copied once

    # Chunk c's part, reassembled from its extents, is vLLM's layout: tensor 0 pages then tensor 1 pages.
    t0, t1 = (t.numpy().view(np.uint8) for t in layout.tensors)
    for c in range(num_chunks):
        got = np.concatenate([pool[o : o + n] for o, n in per_chunk[c]])[:part]
        want = np.concatenate(
            [t0[blocks[c * 4 : (c + 1) * 4]].reshape(-1), t1[blocks[c * 4 : (c + 1) * 4]].reshape(-1)]
        )
        assert np.array_equal(got, want)

    # Load back into other blocks of a fresh cache, starting 1 block into the first chunk.
    other = kv_layout(seed=1)
    dst = np.array([30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 19])
    load = other.copies(dst, [11], [1], extents, pool.ctypes.data, to_pool=False)
    run_copies_cpu(load)
    for i, b in enumerate(dst):
        src_block = blocks[i + 1]
        for mine, theirs in zip(other.tensors, layout.tensors):
            assert torch.equal(mine[b], theirs[src_block])


@pytest.mark.parametrize("to_pool", [True, False])
def test_no_copy_crosses_a_separately_pinned_piece_of_the_pool(to_pool):
    layout = kv_layout()
    part = layout.part_bytes
    pool = np.zeros(part * 4, dtype=np.uint8)
    piece = 1000  # pieces far smaller than a copy: every merged copy is cut
    extents = ChunkExtents.from_lists([[(0, part)], [(part, part)]])  # contiguous: copies merge across chunks
    blocks = np.arange(8)
    whole = layout.copies(blocks, [8], [0], extents, pool.ctypes.data, to_pool, piece_bytes=1 << 40)
    cut = layout.copies(blocks, [8], [0], extents, pool.ctypes.data, to_pool, piece_bytes=piece)
    assert cut.total_bytes == whole.total_bytes and len(cut) > len(whole)
    pool_side = (cut.dst if to_pool else cut.src) - np.uint64(pool.ctypes.data)
    last = pool_side + cut.sizes.astype(np.uint64) - np.uint64(1)
    assert np.all(pool_side // piece == last // piece)
    if to_pool:  # and the bytes land where the uncut copies put them
        run_copies_cpu(cut)
        expected = pool.copy()
        pool[:] = 0
        run_copies_cpu(whole)
        assert np.array_equal(pool, expected)


def test_chunks_without_slot_are_skipped():
    layout = kv_layout()
    pool = np.zeros(layout.part_bytes * 2, dtype=np.uint8)
    extents = ChunkExtents.from_lists([[], [(0, layout.part_bytes)]])  # chunk 0 already present elsewhere
    copies = layout.copies(np.arange(8), [8], [0], extents, pool.ctypes.data, to_pool=True)
    assert copies.total_bytes == 4 * sum(PAGES)


def test_mismatched_groups_are_refused():
    layout = kv_layout()
    extents = ChunkExtents.from_lists([[(0, layout.part_bytes)]])
    with pytest.raises(ValueError):
        layout.copies(np.arange(8), [8], [0], extents, 0, to_pool=True)
