# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Chunk buffers: numpy arrays, torch tensors (CPU or CUDA) and bytes, as flat uint8 views.

`data` for n chunks is either one buffer of n * chunk_bytes bytes (row i is chunk i) or a
sequence of n buffers of chunk_bytes each. CPU data becomes numpy views (no copy); CUDA tensors
stay tensors and are copied against a torch view of the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from kvstored_client.copy_policy import part_count

_stream_copy: Callable[[Any, Any], None] | None
try:  # the optional C helper (client/setup.py): large copies with non-temporal stores
    from kvstored_client._ntcopy import copy as _stream_copy
except ImportError:  # built without a C compiler: numpy (glibc memcpy, cached stores for chunk sizes)
    _stream_copy = None

STREAMING = _stream_copy is not None

Pairs = Sequence[tuple[Sequence[Any], Any]]  # (pool extents, caller view) per chunk


class PoolArrays:
    """The daemon's pool as flat uint8 arrays: numpy, and a torch tensor made on first use (for
    copies to and from CUDA tensors). `buffer` is the pool's mapping (anything writable that
    exposes the buffer protocol)."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer
        self.numpy: np.ndarray | None = np.frombuffer(buffer, dtype=np.uint8)
        self._torch: Any = None

    def torch(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch.frombuffer(self._buffer, dtype=torch.uint8)
        return self._torch

    def for_view(self, view: Any) -> Any:
        """The array a copy against `view` uses: torch for tensors, numpy otherwise."""
        if _is_torch(view):
            return self.torch()
        if self.numpy is None:
            raise ValueError("the pool mapping is closed")
        return self.numpy

    def release(self) -> None:
        """Drop the arrays, so the mapping can be closed."""
        self.numpy = None
        self._torch = None


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "is_cuda")


def _flat(obj: Any, writable: bool) -> Any:
    if _is_torch(obj):
        if writable and not obj.is_contiguous():
            raise ValueError("output tensors must be contiguous")
        import torch

        flat = obj.contiguous().view(torch.uint8).reshape(-1)
        return flat if obj.is_cuda else flat.numpy()
    if isinstance(obj, np.ndarray):
        if writable and not (obj.flags.c_contiguous and obj.flags.writeable):
            raise ValueError("output arrays must be C-contiguous and writable")
        return np.ascontiguousarray(obj).view(np.uint8).reshape(-1)
    arr = np.frombuffer(obj, dtype=np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError(f"output buffer of type {type(obj).__name__} is read-only")
    return arr


def chunk_views(data: Any, n: int, chunk_bytes: int, writable: bool) -> list[Any]:
    """n flat uint8 views of chunk_bytes each; ValueError names what does not fit."""
    if isinstance(data, (list, tuple)):
        if len(data) != n:
            raise ValueError(f"{n} keys but {len(data)} buffers")
        views = [_flat(d, writable) for d in data]
        for i, v in enumerate(views):
            if v.shape[0] != chunk_bytes:
                raise ValueError(f"buffer {i} is {v.shape[0]} bytes; the namespace's chunks are {chunk_bytes}")
        return views
    flat = _flat(data, writable)
    if flat.shape[0] != n * chunk_bytes:
        raise ValueError(f"buffer is {flat.shape[0]} bytes; {n} chunks of {chunk_bytes} need {n * chunk_bytes}")
    return [flat[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(n)]


def copy_cpu(dst: np.ndarray, src: np.ndarray) -> None:
    """One copy between flat uint8 arrays. Chunk-sized copies are far below glibc's threshold for
    cache-bypassing stores (derived from the L3 size), where memcpy runs at ~0.6x of a large
    copy; the helper streams them past the cache (neither side reads the bytes soon)."""
    if _stream_copy is not None:
        _stream_copy(dst, src)
    else:
        dst[...] = src


def copy_in(pool_arrays: PoolArrays, extents: Sequence[Any], src: Any) -> None:
    """src -> the pool slots described by extents (protobuf Extent messages)."""
    pool, pos = pool_arrays.for_view(src), 0
    for ext in extents:
        dst = pool[ext.offset : ext.offset + ext.length]
        if isinstance(dst, np.ndarray):
            copy_cpu(dst, src[pos : pos + ext.length])
        else:
            dst.copy_(src[pos : pos + ext.length])
        pos += ext.length


def copy_out(pool_arrays: PoolArrays, extents: Sequence[Any], dst: Any) -> None:
    """The pool slots described by extents -> dst."""
    pool, pos = pool_arrays.for_view(dst), 0
    for ext in extents:
        src = pool[ext.offset : ext.offset + ext.length]
        if isinstance(src, np.ndarray):
            copy_cpu(dst[pos : pos + ext.length], src)
        else:
            dst[pos : pos + ext.length].copy_(src)
        pos += ext.length


class ChunkCopier:
    """Copies a batch of chunks between caller buffers and pool slots. A large CPU batch is split
    across threads (numpy releases the GIL; one core's memcpy reaches a fraction of memory
    bandwidth); CUDA tensors are copied in order on the caller's thread."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {threads}")
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None

    def copy(self, pool: PoolArrays, pairs: Pairs, to_pool: bool) -> None:
        """pairs: (extents, caller view) per chunk. Returns, or raises, only once no thread
        touches the pool for this batch (the caller releases the slots right after)."""
        parts = self._split(pairs)
        if len(parts) == 1:
            _copy_part(pool, pairs, to_pool)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kvstored-client-copy")
        futures = [self._executor.submit(_copy_part, pool, part, to_pool) for part in parts]
        _wait_all(futures)

    def _split(self, pairs: Pairs) -> list[Pairs]:
        if self.threads == 1 or not pairs or _is_torch(pairs[0][1]):
            return [pairs]
        total = sum(len(view) for _, view in pairs)
        n = part_count(total, len(pairs), self.threads)
        if n == 1:
            return [pairs]
        per = -(-len(pairs) // n)  # chunks of one batch share one size
        return [pairs[i : i + per] for i in range(0, len(pairs), per)]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _copy_part(pool: PoolArrays, part: Pairs, to_pool: bool) -> None:
    one: Callable[[PoolArrays, Sequence[Any], Any], None] = copy_in if to_pool else copy_out
    for extents, view in part:
        one(pool, extents, view)


def _wait_all(futures: list[Future[None]]) -> None:
    """Wait for every copy even if this thread is interrupted meanwhile; then raise the first error."""
    interrupted: BaseException | None = None
    while not all(f.done() for f in futures):
        try:
            wait(futures)
        except BaseException as exc:  # KeyboardInterrupt: the pages are still being written
            interrupted = exc
    if interrupted is not None:
        raise interrupted
    for f in futures:
        f.result()
