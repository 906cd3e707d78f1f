# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The direct spec's copy path: KV blocks between vLLM's paged KV-cache tensors and chunk slots in
the daemon's shared-memory pool. Imports neither vLLM nor the daemon (the GPU check runs it alone).

Layout of one worker's part of a chunk (the same as one worker's slot in vLLM's CPU tier): for each
KV-cache tensor t in order, `blocks_per_chunk` pages of `page_bytes[t]`, back to back. A chunk part
lives in the pool as one or more extents (runs of pool pages) that the daemon grants.

A transfer becomes a list of (source address, destination address, size) copies, built with numpy
(one per block and layer reference, merged where both sides are contiguous) and run by a backend:
`cudaMemcpyAsync` on a stream for CUDA tensors (the pool pinned with cudaHostRegister, so the copy
engine moves the bytes straight between GPU memory and the daemon's pool), `memmove` for CPU
tensors (the stand-in used by tests).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_CUDA_MEMCPY_DEFAULT = 4
_CUDA_HOST_REGISTER_PORTABLE = 1
MAX_HOST_REGISTER_BYTES = 64 << 30  # register big pools in pieces (driver limits)


@dataclass(frozen=True)
class LayerRef:
    """One layer's data in a KV-cache tensor: which tensor, and the (unpadded) bytes per block."""

    tensor_idx: int
    page_size_bytes: int


@dataclass(frozen=True)
class Copies:
    """Copy descriptors: src[i] -> dst[i], sizes[i] bytes (addresses as uint64)."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def __len__(self) -> int:
        return len(self.sizes)


class ChunkExtents:
    """Where each chunk's part lives in the pool: chunk i is ext_offsets[starts[i]:starts[i+1]]
    (pool byte offsets) with ext_lengths; a chunk with no extents is skipped."""

    def __init__(self, starts: np.ndarray, ext_offsets: np.ndarray, ext_lengths: np.ndarray) -> None:
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ext_offsets = np.asarray(ext_offsets, dtype=np.uint64)
        self.ext_lengths = np.asarray(ext_lengths, dtype=np.uint64)

    @classmethod
    def from_lists(cls, per_chunk: Sequence[Sequence[tuple[int, int]]]) -> ChunkExtents:
        starts = np.zeros(len(per_chunk) + 1, dtype=np.int64)
        starts[1:] = np.cumsum([len(e) for e in per_chunk])
        flat = [x for e in per_chunk for x in e]
        offsets = np.array([o for o, _ in flat], dtype=np.uint64)
        lengths = np.array([n for _, n in flat], dtype=np.uint64)
        return cls(starts, offsets, lengths)

    def __len__(self) -> int:
        return len(self.starts) - 1


class KVLayout:
    """vLLM's KV-cache tensors of one worker, and the chunk-part layout derived from them."""

    def __init__(
        self,
        tensors: Sequence,
        group_refs: Sequence[Sequence[LayerRef]],
        blocks_per_chunk: int,
        page_bytes: Sequence[int] | None = None,
    ) -> None:
        """tensors: the KV-cache tensors, first dimension = blocks (any dtype; GPU or CPU);
        group_refs: per KV-cache group, the layers' references into `tensors`;
        page_bytes: bytes per block of each tensor (vLLM's possibly padded page size; default:
        the tensor's bytes divided by its first dimension)."""
        import torch

        if page_bytes is None:
            page_bytes = [t.numel() * t.element_size() // t.shape[0] for t in tensors]
        self.tensors = []
        for t, page in zip(tensors, page_bytes):
            if not t.is_contiguous():
                raise ValueError("KV-cache tensors must be contiguous")
            self.tensors.append(t.view(torch.int8).view(-1, page))
        self.page_bytes = [int(p) for p in page_bytes]
        self.group_refs = [list(refs) for refs in group_refs]
        self.blocks_per_chunk = blocks_per_chunk
        self.tensor_offsets = np.concatenate([[0], np.cumsum(self.page_bytes)[:-1]]).astype(np.int64) * blocks_per_chunk
        self.part_bytes = int(sum(self.page_bytes)) * blocks_per_chunk
        self.is_cuda = bool(self.tensors) and self.tensors[0].is_cuda
        self._base = [t.data_ptr() for t in self.tensors]

    def block_positions(
        self, gpu_blocks: np.ndarray, group_sizes: Sequence[int], block_indices: Sequence[int], num_chunks: int
    ) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """Per group: (group index, GPU block ids, chunk index, sub-block index) of every block moved.

        Mirrors vLLM's CPU worker: group g's blocks map onto consecutive sub-blocks of the group's
        chunks, starting `block_indices[g] % blocks_per_chunk` into the first chunk."""
        bpc = self.blocks_per_chunk
        out = []
        block_pos = chunk_pos = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices)):
            if size == 0:
                continue
            skip = first % bpc
            chunks = -(-(size + skip) // bpc)
            flat = np.arange(skip, skip + size, dtype=np.int64)
            out.append(
                (
                    g,
                    np.asarray(gpu_blocks[block_pos : block_pos + size], dtype=np.int64),
                    chunk_pos + flat // bpc,
                    flat % bpc,
                )
            )
            block_pos += size
            chunk_pos += chunks
        if block_pos != len(gpu_blocks) or chunk_pos != num_chunks:
            raise ValueError(
                f"{len(gpu_blocks)} GPU blocks and {num_chunks} chunks do not match "
                f"group_sizes={list(group_sizes)} block_indices={list(block_indices)}"
            )
        return out

    def copies(
        self,
        gpu_blocks: np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        extents: ChunkExtents,
        pool_address: int,
        to_pool: bool,
        piece_bytes: int = MAX_HOST_REGISTER_BYTES,
    ) -> Copies:
        """The copies that move the given GPU blocks to (to_pool) or from their chunk parts. No
        copy crosses a `piece_bytes` boundary of the pool (each piece is pinned on its own)."""
        gpu_parts: list[np.ndarray] = []
        off_parts: list[np.ndarray] = []
        idx_parts: list[np.ndarray] = []
        size_parts: list[np.ndarray] = []
        for g, blocks, chunks, subs in self.block_positions(gpu_blocks, group_sizes, block_indices, len(extents)):
            for ref in self.group_refs[g]:
                t = ref.tensor_idx
                gpu_parts.append(self._base[t] + blocks.astype(np.uint64) * np.uint64(self.page_bytes[t]))
                off_parts.append(self.tensor_offsets[t] + subs * self.page_bytes[t])
                idx_parts.append(chunks)
                size_parts.append(np.full(len(blocks), ref.page_size_bytes, dtype=np.int64))
        if not size_parts:
            return _empty()
        gpu_addr = np.concatenate(gpu_parts).astype(np.uint64)
        part_off = np.concatenate(off_parts)
        chunk_idx = np.concatenate(idx_parts)
        sizes = np.concatenate(size_parts)
        # Drop blocks of chunks that have no slot (not reserved, or already present).
        has_slot = np.diff(extents.starts) > 0
        keep = has_slot[chunk_idx]
        gpu_addr, part_off, chunk_idx, sizes = gpu_addr[keep], part_off[keep], chunk_idx[keep], sizes[keep]
        pool_addr, gpu_addr, sizes = _through_extents(
            extents, self.part_bytes, chunk_idx, part_off, sizes, gpu_addr, pool_address
        )
        src, dst = (gpu_addr, pool_addr) if to_pool else (pool_addr, gpu_addr)
        return _split_at_pieces(_merge(src, dst, sizes), pool_address, piece_bytes, to_pool)


def _split_at_pieces(copies: Copies, pool_address: int, piece_bytes: int, to_pool: bool) -> Copies:
    """Cut copies whose pool side crosses a boundary between separately pinned pieces of the pool
    (a DMA must stay within one registration)."""
    pool_side = copies.dst if to_pool else copies.src
    if len(copies) == 0:
        return copies
    start = pool_side - np.uint64(pool_address)
    end = start + copies.sizes.astype(np.uint64) - np.uint64(1)
    crossing = np.nonzero(start // np.uint64(piece_bytes) != end // np.uint64(piece_bytes))[0]
    if len(crossing) == 0:
        return copies
    src, dst, sizes = copies.src.tolist(), copies.dst.tolist(), copies.sizes.tolist()
    out_src: list[int] = []
    out_dst: list[int] = []
    out_sizes: list[int] = []
    cut = set(crossing.tolist())
    for i, (s, d, n) in enumerate(zip(src, dst, sizes)):
        if i not in cut:
            out_src.append(s)
            out_dst.append(d)
            out_sizes.append(n)
            continue
        offset = 0
        while offset < n:
            pool_pos = (d if to_pool else s) + offset - pool_address
            step = min(n - offset, piece_bytes - pool_pos % piece_bytes)
            out_src.append(s + offset)
            out_dst.append(d + offset)
            out_sizes.append(step)
            offset += step
    return Copies(
        np.array(out_src, dtype=np.uint64), np.array(out_dst, dtype=np.uint64), np.array(out_sizes, dtype=np.int64)
    )


def _empty() -> Copies:
    z = np.zeros(0, dtype=np.uint64)
    return Copies(z, z, z.astype(np.int64))


def _through_extents(
    extents: ChunkExtents,
    part_bytes: int,
    chunk_idx: np.ndarray,
    part_off: np.ndarray,
    sizes: np.ndarray,
    gpu_addr: np.ndarray,
    pool_address: int,
):
    """Map (chunk, offset in its part) to pool addresses; a copy crossing an extent boundary is split."""
    if len(sizes) == 0:
        return gpu_addr, gpu_addr, sizes
    n_ext = np.diff(extents.starts)
    ext_chunk = np.repeat(np.arange(len(extents)), n_ext)
    ext_part_start = np.zeros(len(extents.ext_lengths), dtype=np.int64)
    for i in np.nonzero(n_ext)[0]:  # offset of each extent inside its chunk part
        a, b = extents.starts[i], extents.starts[i + 1]
        ext_part_start[a:b] = np.concatenate([[0], np.cumsum(extents.ext_lengths[a : b - 1].astype(np.int64))])
    ext_len = extents.ext_lengths.astype(np.int64)
    covered = np.zeros(len(extents), dtype=np.int64)
    np.add.at(covered, ext_chunk, ext_len)
    short = (n_ext > 0) & (covered < part_bytes)
    if short.any():
        bad = int(np.nonzero(short)[0][0])
        raise ValueError(f"chunk {bad}: slot of {covered[bad]} bytes is smaller than a chunk part ({part_bytes})")
    key = chunk_idx * part_bytes + part_off
    ext_key = ext_chunk * part_bytes + ext_part_start
    idx = np.searchsorted(ext_key, key, side="right") - 1
    inside = part_off - ext_part_start[idx]
    fits = inside + sizes <= ext_len[idx]
    pool = np.uint64(pool_address) + extents.ext_offsets[idx] + inside.astype(np.uint64)
    if fits.all():
        return pool, gpu_addr, sizes
    out_pool, out_gpu, out_size = [pool[fits]], [gpu_addr[fits]], [sizes[fits]]
    for i in np.nonzero(~fits)[0]:
        e, off, left, g = int(idx[i]), int(inside[i]), int(sizes[i]), int(gpu_addr[i])
        while left > 0:
            n = min(left, int(ext_len[e]) - off)
            out_pool.append(np.array([pool_address + int(extents.ext_offsets[e]) + off], dtype=np.uint64))
            out_gpu.append(np.array([g], dtype=np.uint64))
            out_size.append(np.array([n], dtype=np.int64))
            g, left, e, off = g + n, left - n, e + 1, 0
    return np.concatenate(out_pool), np.concatenate(out_gpu), np.concatenate(out_size)


def _merge(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> Copies:
    """Sort by destination and merge copies that continue each other on both sides."""
    if len(sizes) == 0:
        return _empty()
    order = np.lexsort((sizes, src, dst))
    src, dst, sizes = src[order], dst[order], sizes[order]
    # Layers that share a tensor give the same copy twice: once is enough.
    unique = np.ones(len(sizes), dtype=bool)
    unique[1:] = (src[1:] != src[:-1]) | (dst[1:] != dst[:-1]) | (sizes[1:] != sizes[:-1])
    src, dst, sizes = src[unique], dst[unique], sizes[unique]
    ends_s, ends_d = src + sizes.astype(np.uint64), dst + sizes.astype(np.uint64)
    starts_run = np.ones(len(sizes), dtype=bool)
    starts_run[1:] = (src[1:] != ends_s[:-1]) | (dst[1:] != ends_d[:-1])
    run_id = np.cumsum(starts_run) - 1
    merged_sizes = np.zeros(run_id[-1] + 1, dtype=np.int64)
    np.add.at(merged_sizes, run_id, sizes)
    return Copies(src[starts_run], dst[starts_run], merged_sizes)


# -- execution ---------------------------------------------------------------------------------


def run_copies_cpu(copies: Copies) -> None:
    for s, d, n in zip(copies.src.tolist(), copies.dst.tolist(), copies.sizes.tolist()):
        ctypes.memmove(d, s, n)


class CudaRuntime:
    """The few CUDA runtime calls the copy path needs, through the libcudart torch loaded."""

    def __init__(self) -> None:
        import torch

        torch.cuda.init()
        self._lib = ctypes.CDLL(_cudart_path())
        self._memcpy = self._lib.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._register = self._lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = self._lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        # A failed runtime call leaves its error pending for the thread; torch's next launch
        # check would raise it inside the model's forward pass. Clear it where we fail.
        self._clear_error = self._lib.cudaGetLastError
        self._clear_error.argtypes = []
        self._clear_error.restype = ctypes.c_int

    def copy_async(self, copies: Copies, stream_handle: int) -> None:
        memcpy = self._memcpy
        for s, d, n in zip(copies.src.tolist(), copies.dst.tolist(), copies.sizes.tolist()):
            err = memcpy(d, s, n, _CUDA_MEMCPY_DEFAULT, stream_handle)
            if err:
                self._clear_error()
                raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {err}")

    def host_register(self, address: int, size: int) -> list[int]:
        """Pin [address, address+size) in pieces; returns the registered piece addresses (empty if
        the driver refused, e.g. a memlock limit: copies then still work, staged by the driver)."""
        done: list[int] = []
        for off in range(0, size, MAX_HOST_REGISTER_BYTES):
            n = min(MAX_HOST_REGISTER_BYTES, size - off)
            if self._register(address + off, n, _CUDA_HOST_REGISTER_PORTABLE):
                self._clear_error()
                for a in done:
                    self._unregister(a)
                self._clear_error()
                return []
            done.append(address + off)
        return done

    def host_unregister(self, addresses: list[int]) -> None:
        for a in addresses:
            if self._unregister(a):
                self._clear_error()


def _cudart_path() -> str:
    """The CUDA runtime torch uses: the one already loaded, else one shipped beside torch."""
    loaded = _loaded_library("libcudart")
    if loaded:
        return loaded
    import glob
    import os

    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    for pattern in ("torch/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/*/lib/libcudart.so*"):
        found = sorted(glob.glob(os.path.join(site, pattern)))
        if found:
            return found[-1]
    return ctypes.util.find_library("cudart") or "libcudart.so"


def _loaded_library(stem: str) -> str | None:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(maxsplit=1)[-1]
            name = path.rsplit("/", 1)[-1]
            if name.startswith(stem + ".so"):
                return path
    return None


class MappedPool:
    """The daemon's pool mapped from its memfd, optionally pinned for DMA (CUDA)."""

    def __init__(self, fd: int, size: int, pool_id: str, cuda: CudaRuntime | None, populate: bool = True) -> None:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self.map = mmap.mmap(fd, size, flags=flags)
        self.size = size
        self.pool_id = pool_id
        self.array: np.ndarray | None = np.frombuffer(self.map, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self._cuda = cuda
        self.pinned = cuda.host_register(self.address, size) if cuda is not None else []

    def close(self) -> None:
        if self._cuda is not None and self.pinned:
            self._cuda.host_unregister(self.pinned)
            self.pinned = []
        self.array = None
        try:
            self.map.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            pass
