# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Reading a daemon's ZMQ KV events as a router would: replay requests, raw frames, and block
identities made the way vLLM's engine makes them (per engine block, chained)."""

from __future__ import annotations

import hashlib

import msgpack
import zmq

from kvstored_client import BlockIdentity, chunk_identities

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay(replay_port: int, start_seq: int = 0) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) of every batch the replay socket sends from `start_seq`."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.RCVTIMEO = 10_000
        sock.connect(f"tcp://127.0.0.1:{replay_port}")
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[bytes, int, bytes]] = []
        while True:
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        ctx.destroy(linger=0)


def events_of(batches: list[tuple[bytes, int, bytes]]) -> list[dict]:
    """Every event of the batches (map encoding), in order."""
    return [e for _, _, payload in batches for e in msgpack.unpackb(payload)[1]]


def prompt_identities(
    label: str, chunks: int, block_size: int = 16, blocks_per_chunk: int = 4
) -> tuple[list[int], list[BlockIdentity]]:
    """Token ids of a prompt of `chunks` whole chunks and its chunks' identities, with engine
    block hashes chained as vLLM chains them (sha256 over the parent and the block's tokens; the
    tests that compare with vLLM's own hashes use vLLM's function instead)."""
    seed = int.from_bytes(hashlib.sha256(label.encode()).digest()[:4], "big")
    tokens = [(seed + i * 7919) % 50_000 for i in range(chunks * blocks_per_chunk * block_size)]
    hashes: list[bytes] = []
    parent = b"none"
    for b in range(chunks * blocks_per_chunk):
        block = tokens[b * block_size : (b + 1) * block_size]
        parent = hashlib.sha256(parent + repr(block).encode()).digest()
        hashes.append(parent)
    return tokens, chunk_identities(hashes, tokens, block_size, blocks_per_chunk)
