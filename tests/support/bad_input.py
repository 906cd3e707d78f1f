# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Helpers for hostile-input tests: raw bytes over a real gRPC channel, and what a daemon log must
not contain after them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

# How long a status message may be, in UTF-8 bytes: gRPC carries it in a trailer, and the
# client's gRPC refuses trailers over 8 KiB (percent-encoding can triple the bytes).
MAX_DETAILS_BYTES = 1024
# Bytes no request message decodes from: a corrupt wire format, a field cut short.
UNDECODABLE = (b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a")
TIMEOUT_S = 10.0


def raw_unary(channel: grpc.Channel, path: str, server_streaming: bool) -> Callable[[bytes], Any]:
    """A call that sends `payload` as the request bytes, unparsed (responses stay bytes too)."""
    if server_streaming:
        stream = channel.unary_stream(path)
        return lambda payload: list(stream(payload, timeout=TIMEOUT_S))
    unary = channel.unary_unary(path)
    return lambda payload: unary(payload, timeout=TIMEOUT_S)


def tracebacks(log: str) -> list[str]:
    """Lines of a daemon log that show a traceback or an ERROR record."""
    return [line for line in log.splitlines() if "Traceback" in line or " ERROR " in line]
