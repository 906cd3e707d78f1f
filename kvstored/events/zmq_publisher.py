# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""KV events on a ZMQ PUB socket in vLLM's wire format, for llm-d / Dynamo style routers.

Each message is multipart `[topic, seq (8 bytes big-endian), msgpack(EventBatch)]`, where the
batch is vLLM's array-like `[ts, [event, ...]]`. Events are BlockStored / BlockRemoved, encoded
either as vLLM 0.33's tagged maps (`{"type": "BlockStored", ...}`) or as the positional arrays
older consumers decode (`["BlockStored", hashes, parent, ...]`).
A ROUTER replay socket answers `[b"", start_seq (8 bytes)]` with every buffered batch from that
seq, then an end marker (seq -1), as vLLM's ZmqEventPublisher does.

A namespace clear is published as BlockRemoved for each removed key only: vLLM's AllBlocksCleared
means every block of the publisher, so the bus's per-namespace CLEARED is never sent. Batches are
numbered by this publisher (no gaps where a CLEARED was left out), not by the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvstored.chunks.ids import TierKind
from kvstored.errors import ListenError
from kvstored.events.bus import EventEncoding, EventType, KvEvent

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MEDIUM = {TierKind.RAM: "CPU", TierKind.FS: "STORAGE", TierKind.S3: "STORAGE", TierKind.PEER: "STORAGE"}
_LOCALITY = {TierKind.RAM: "LOCAL", TierKind.FS: "LOCAL", TierKind.S3: "REMOTE", TierKind.PEER: "REMOTE"}


def encode_event(event: KvEvent, block_size: int, encoding: EventEncoding) -> Any:
    medium = _MEDIUM.get(event.tier_kind)
    hashes = list(event.keys)
    if event.type is EventType.STORED:
        if encoding is EventEncoding.ARRAY:
            return ["BlockStored", hashes, None, [], block_size, None, medium]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
            "locality": _LOCALITY.get(event.tier_kind),
            "ownership": event.tier,
        }
    if event.type is EventType.REMOVED:
        if encoding is EventEncoding.ARRAY:
            return ["BlockRemoved", hashes, medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": hashes,
            "medium": medium,
            "locality": _LOCALITY.get(event.tier_kind),
            "ownership": event.tier,
        }
    raise ValueError(f"no vLLM event for {event.type!r}")  # CLEARED: see _published


def encode_batch(event: KvEvent, block_size: int, encoding: EventEncoding) -> bytes:
    return msgpack.packb([event.ts, [encode_event(event, block_size, encoding)]], use_bin_type=True)


def _published(event: KvEvent) -> bool:
    """CLEARED is one namespace's: as AllBlocksCleared a router would forget every namespace.
    The chain publishes the cleared keys as REMOVED events before it."""
    return event.type is not EventType.CLEARED


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        encoding: EventEncoding,
        block_size_of: Callable[[str], int],
        buffer_batches: int = 10_000,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._encoding = encoding
        self._block_size_of = block_size_of
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        # Like vLLM's publisher: a full replay plus its end marker, twice over, fits in the
        # ROUTER's send queue (past its high-water mark ROUTER silently drops messages).
        self._replay_hwm = 2 * (buffer_batches + 1)
        self._seq = itertools.count(1)
        self._ctx = zmq.asyncio.Context()  # the replay socket is served on the event loop
        self._pub_ctx = zmq.Context()  # PUB sends are plain non-blocking calls
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None
        self.sent = 0

    def start(self) -> None:
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        _bind(self._pub, self._endpoint, "events_zmq_endpoint")
        if self._replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, self._replay_hwm)  # before bind: pipes take it then
            _bind(self._replay, self._replay_endpoint, "events_zmq_replay_endpoint")
            self._replay_task = asyncio.create_task(self._serve_replay(self._replay), name="zmq-replay")
        log.info(
            "KV events on %s (replay %s, %s encoding)",
            self._endpoint,
            self._replay_endpoint or "off",
            self._encoding.value,
        )

    def __call__(self, event: KvEvent) -> None:
        """Bus listener: publish at once. PUB never blocks: past its high-water mark ZMQ drops."""
        if self._pub is None or not _published(event):
            return
        payload = encode_batch(event, self._block_size_of(event.namespace_id), self._encoding)
        seq = next(self._seq)
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent += 1

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()
        self._pub_ctx.term()


def _bind(sock: zmq.Socket, endpoint: str, option: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ListenError(f"cannot listen on {endpoint} ({option}): {exc}") from None
