# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Copies between client regions and the pool that a shrinking region file cannot turn into a
daemon crash (see _safecopy.c). Without the compiled helper, copies are plain numpy copies."""

from __future__ import annotations

import numpy as np

try:
    from kvstored.shm._safecopy import copy as _guarded_copy
except ImportError:  # built without a C compiler: still correct, just not SIGBUS-proof
    _guarded_copy = None

GUARDED = _guarded_copy is not None


class MappingVanished(Exception):
    """A mapped file shrank under a copy (the copy faulted and was abandoned)."""


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    if _guarded_copy is None:
        dst[...] = src
        return
    try:
        _guarded_copy(dst, src)
    except BufferError as exc:
        raise MappingVanished(str(exc)) from None
