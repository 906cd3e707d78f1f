"""What every tier shares."""

from __future__ import annotations

import enum


class TierKind(enum.IntEnum):
    """Mirrors kvstored.v1.TierKind; 0 is a miss."""

    NONE = 0
    RAM = 1
    FS = 2
    S3 = 3
    PEER = 4
