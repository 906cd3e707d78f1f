# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Deterministic test keys and chunk payloads, shared by tests and worker subprocesses."""

from __future__ import annotations

import hashlib

import numpy as np


def make_keys(label: str, n: int, start: int = 0, key_bytes: int = 32) -> list[bytes]:
    """n distinct keys, the same in every process for the same label."""
    return [hashlib.sha256(f"{label}/{i}".encode()).digest()[:key_bytes] for i in range(start, start + n)]


def payload(key: bytes, size: int) -> np.ndarray:
    """The chunk bytes a key stands for (pseudo-random, derived from the key alone)."""
    seed = int.from_bytes(hashlib.sha256(b"payload:" + key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def payloads(keys: list[bytes], size: int) -> np.ndarray:
    """One (len(keys), size) uint8 array: row i is payload(keys[i])."""
    out = np.empty((len(keys), size), dtype=np.uint8)
    for i, key in enumerate(keys):
        out[i] = payload(key, size)
    return out
