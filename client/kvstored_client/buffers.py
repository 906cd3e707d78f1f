"""Chunk buffers: numpy arrays, torch tensors (CPU or CUDA) and bytes, as flat uint8 views.

`data` for n chunks is either one buffer of n * chunk_bytes bytes (row i is chunk i) or a
sequence of n buffers of chunk_bytes each. CPU data becomes numpy views (no copy); CUDA tensors
stay tensors and are copied against a torch view of the pool.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvstored_client.session import PoolSession


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
    return [flat[i * chunk_bytes:(i + 1) * chunk_bytes] for i in range(n)]


def _pool_for(session: PoolSession, view: Any) -> Any:
    return session.torch_pool() if _is_torch(view) else session.pool


def copy_in(session: PoolSession, extents: Sequence[Any], src: Any) -> None:
    """src -> the pool slots described by extents (protobuf Extent messages)."""
    pool, pos = _pool_for(session, src), 0
    for ext in extents:
        dst = pool[ext.offset:ext.offset + ext.length]
        if isinstance(dst, np.ndarray):
            dst[...] = src[pos:pos + ext.length]
        else:
            dst.copy_(src[pos:pos + ext.length])
        pos += ext.length


def copy_out(session: PoolSession, extents: Sequence[Any], dst: Any) -> None:
    pool, pos = _pool_for(session, dst), 0
    for ext in extents:
        src = pool[ext.offset:ext.offset + ext.length]
        if isinstance(src, np.ndarray):
            dst[pos:pos + ext.length] = src
        else:
            dst[pos:pos + ext.length].copy_(src)
        pos += ext.length
