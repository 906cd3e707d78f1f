# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Swap two paths back and forth with renameat2(RENAME_EXCHANGE) until stdin closes, then print
the number of swaps. Run as a process of its own (`python -m tests.support.swap A B`), so the
swaps race the daemon without waiting on the test's GIL.

Used to race a directory against a symlink: each exchange is atomic, so at every instant one of
the two names is the directory and the other the symlink."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

AT_FDCWD = -100
RENAME_EXCHANGE = 2


def _set_at_eof(event: threading.Event) -> None:
    """Set `event` once stdin closes (the parent test ended or let go of us)."""
    sys.stdin.read()
    event.set()


def main(a: str, b: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    stop = threading.Event()
    threading.Thread(target=_set_at_eof, args=(stop,), daemon=True).start()
    ea, eb = os.fsencode(a), os.fsencode(b)
    swaps = 0
    print("ready", flush=True)
    while not stop.is_set():
        if libc.renameat2(AT_FDCWD, ea, AT_FDCWD, eb, RENAME_EXCHANGE) != 0:
            err = ctypes.get_errno()
            print(f"renameat2: {os.strerror(err)}", file=sys.stderr, flush=True)
            return 1
        swaps += 1
    print(swaps, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
