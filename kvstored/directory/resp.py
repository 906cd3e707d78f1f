# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""RESP2, the Redis protocol, as far as the directory speaks it (no I/O).

- encode(): one command as a RESP array of bulk strings (replies are parsed by hiredis' Reader);
- Batch: commands encoded once, each with its key's slot and how many replies it gets back
  (a frame may hold several commands on one key: HSET + PEXPIRE), sent as they are on a retry;
- classify(): what an error reply asks of a cluster client (follow MOVED or ASK, retry, or fail).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

ASKING = b"*1\r\n$6\r\nASKING\r\n"


def bulk(arg: bytes | str | int) -> bytes:
    if isinstance(arg, str):
        arg = arg.encode()
    elif isinstance(arg, int):
        arg = b"%d" % arg
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


def encode(*args: bytes | str | int) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(bulk(a) for a in args)


def asking(frame: bytes) -> bytes:
    """The frame with ASKING before each of its commands (ASKING admits one command only)."""
    out, pos = [], 0
    while pos < len(frame):
        start = pos
        end = frame.index(b"\r\n", pos)
        if frame[pos : pos + 1] != b"*":
            raise ValueError("not a RESP array of bulk strings")
        pos = end + 2
        for _ in range(int(frame[start + 1 : end])):
            end = frame.index(b"\r\n", pos)
            pos = end + 2 + int(frame[pos + 1 : end]) + 2  # ($<length>\r\n<bytes>\r\n)
        out.append(ASKING + frame[start:pos])
    return b"".join(out)


@dataclass(slots=True)
class Batch:
    """Frames to send, in order: the frames of one slot reach its master in this order."""

    frames: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    replies: list[int] = field(default_factory=list)  # replies per frame

    def add(self, slot: int, frame: bytes, replies: int = 1) -> None:
        self.frames.append(frame)
        self.slots.append(slot)
        self.replies.append(replies)

    def __len__(self) -> int:
        return len(self.frames)

    def commands(self) -> int:
        return sum(self.replies)


class Verdict(enum.Enum):
    MOVED = "moved"  # the slot has a new owner: learn it, send there
    ASK = "ask"  # the key is being migrated: send this once to the named node, after ASKING
    RETRY = "retry"  # transient (failover, resharding, loading): again after a pause, map refreshed
    VALUE = "value"  # one key holds another type (WRONGTYPE): that command's reply, for the caller to judge
    FAIL = "fail"  # anything else: the call fails


_TRANSIENT = ("TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN", "READONLY")


@dataclass(frozen=True, slots=True)
class ErrorReply:
    verdict: Verdict
    text: str
    slot: int = -1
    address: tuple[str, int] | None = None  # MOVED / ASK: where to


def classify(message: str) -> ErrorReply:
    """An error reply's text (hiredis' ReplyError), e.g. 'MOVED 3999 10.0.0.3:6379'."""
    word, _, rest = message.partition(" ")
    if word in ("MOVED", "ASK"):
        slot, _, where = rest.partition(" ")
        host, colon, port = where.rpartition(":")
        if colon and slot.isdigit() and port.isdigit():
            verdict = Verdict.MOVED if word == "MOVED" else Verdict.ASK
            return ErrorReply(verdict, message, int(slot), (host.strip("[]"), int(port)))
    if word in _TRANSIENT:
        return ErrorReply(Verdict.RETRY, message)
    if word == "WRONGTYPE":  # (another client's value under our key: that key's problem, not the cluster's)
        return ErrorReply(Verdict.VALUE, message)
    return ErrorReply(Verdict.FAIL, message)
