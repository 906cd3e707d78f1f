# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
from collections.abc import Sequence

def recv_frame(
    fd: int, buffers: Sequence[memoryview], payload: int, step: int, end: float
) -> tuple[int, int, int, int]: ...
def xxh3(data: bytes | bytearray | memoryview) -> int: ...
