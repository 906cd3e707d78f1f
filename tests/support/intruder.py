# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A client process that looks for another tenant's chunks in every byte it can map:
`python -m tests.support.intruder --socket S --model M --chunk C --victim-label L --n N [--salt S]`.

It registers a namespace of its own (with --salt: a tenant's; else a public one) and stores in it
(so every mapping it is entitled to is made), asks the daemon for every arena id up to
--max-arena, then scans each kvstored mapping in /proc/self/maps for the victim's chunks (their
bytes derive from the keys `make_keys(L, N)`), and with --overwrite fills every one of them with
0xAB. Prints one JSON line: mappings, bytes scanned, chunks found, arenas the daemon opened to it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

from kvstored_client import Client
from kvstored_client.errors import NotFound
from tests.support.data import make_keys, payloads

SIGNATURE_BYTES = 256  # a chunk counts as found when its first bytes are


def kvstored_mappings() -> list[tuple[int, int, bool]]:
    """(start, end, writable) of every mapping of a kvstored memfd in this process."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "memfd:kvstored" in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end, "w" in fields[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--chunk", type=int, required=True)
    p.add_argument("--victim-label", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--salt", default="")
    p.add_argument("--max-arena", type=int, default=64)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)

    with Client(args.socket, deadline_s=20.0, client_name="intruder") as client:
        ns = client.register_namespace(
            model=args.model, dtype="uint8", chunk_bytes=args.chunk, tenant_salt=args.salt.encode()
        )
        own = make_keys(f"intruder-{args.salt}", 2)
        client.store(ns, own, payloads(own, args.chunk))
        session = client._session
        assert session is not None
        opened = []
        for arena_id in range(1, args.max_arena + 1):
            try:
                session.map_arena(arena_id)
                opened.append(arena_id)
            except NotFound:
                pass
        victim = [bytes(row[:SIGNATURE_BYTES]) for row in payloads(make_keys(args.victim_label, args.n), args.chunk)]
        mappings = kvstored_mappings()
        scanned = found = 0
        for start, end, _writable in mappings:
            data = ctypes.string_at(start, end - start)
            scanned += len(data)
            found += sum(1 for sig in victim if sig in data)
        if args.overwrite:
            for start, end, writable in mappings:
                if writable:
                    ctypes.memset(start, 0xAB, end - start)
        json.dump({"mappings": len(mappings), "scanned": scanned, "found": found, "opened": opened}, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
