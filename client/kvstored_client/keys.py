# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Content-addressed keys: namespace ids and chained chunk keys from token ids.

Same tokens + same namespace -> same keys in any process on any machine; a change anywhere in a
prefix changes every later key (each key hashes its parent key and its own tokens).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 32


def namespace_id_for(
    model: str, dtype: str, chunk_bytes: int, layout: str, tenant_salt: bytes = b"", key_bytes: int = KEY_BYTES
) -> str:
    """The id every daemon derives for a namespace: 16 bytes of sha256 over its fields, hex."""
    h = hashlib.sha256()
    for part in (
        model.encode(),
        dtype.encode(),
        str(chunk_bytes).encode(),
        layout.encode(),
        bytes(tenant_salt),
        str(key_bytes).encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:32]


def chunk_keys(
    tokens: Sequence[int] | np.ndarray, chunk_tokens: int, namespace_id: str, parent: bytes | None = None
) -> list[bytes]:
    """One 32-byte key per full chunk of `chunk_tokens` tokens; a trailing partial chunk gets none.

    Pass `parent` (the last key of an earlier call) to extend a prefix without rehashing it.
    """
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError("tokens must be a flat sequence of token ids")
    prev = parent if parent is not None else hashlib.sha256(b"kvstored-root:" + namespace_id.encode()).digest()
    keys = []
    for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
        prev = hashlib.sha256(prev + ids[start : start + chunk_tokens].astype("<i8").tobytes()).digest()
        keys.append(prev)
    return keys
