# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Asyncio client: the same operations and failure behaviour as `Client`, on grpc.aio."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from kvstored_client import ops
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.blocks import BlockIdentity
from kvstored_client.client import (
    DEFAULT_DEADLINE_S,
    OPEN_SESSION,
    RAISE,
    ClientBase,
    Plan,
    _bounded,
    _remaining,
    in_session,
)
from kvstored_client.copy_policy import MIN_PART_BYTES as OFF_LOOP_COPY_BYTES  # smaller: a thread hop costs more
from kvstored_client.errors import KvstoredError, Unavailable
from kvstored_client.fast import fast_path_default
from kvstored_client.kinds import LoadInto
from kvstored_client.ops import Health, LookupResult, Namespace, NamespaceSpec, Region, StoreResult
from kvstored_client.protocol import (
    CHANNEL_OPTIONS,
    HEALTH_CHECK,
    channel_target,
    decode_health_response,
    encode_health_request,
)
from kvstored_client.session import PoolSession

log = logging.getLogger(__name__)


class AsyncClient(ClientBase):
    def __init__(
        self,
        socket: str | os.PathLike | None = None,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        client_name: str | None = None,
        populate: bool = True,
        copy_threads: int | None = None,
        fast_path: bool | None = None,
    ) -> None:
        """copy_threads: threads splitting a large store/load between your buffers and the pool
        (default: up to 4, one per core). fast_path: as Client's."""
        super().__init__(socket, deadline_s, client_name, populate, copy_threads)
        self.fast_path = fast_path_default() if fast_path is None else fast_path
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.KVStoreStub | None = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        self._check_fork()
        async with self._lock:  # not under a call's copy into the pool
            self._drop_session()
            self._close_regions()
            if self._channel is not None:
                await self._channel.close()
                self._channel = self._stub = None

    async def register_namespace(self, spec: NamespaceSpec | None = None, **fields: Any) -> Namespace:
        spec = spec or NamespaceSpec(**fields)
        ns = self._namespace_local(spec)
        result = await self._run(lambda s: ops.register(spec, s), None, session=ns.private)
        return result or ns

    async def lookup(self, ns: Namespace, keys: Sequence[bytes], load_into: LoadInto = LoadInto.POOL) -> LookupResult:
        """Where each key is. `load_into`: what the load that follows uses, load (POOL) or
        load_to_region (REGION); it decides how the daemon readies the hits below RAM."""
        return await self._run(
            lambda s: ops.lookup(ns, keys, s, load_into), LookupResult.miss(len(keys)), session=ns.private
        )

    async def store(
        self, ns: Namespace, keys: Sequence[bytes], data: Any, blocks: Sequence[BlockIdentity | None] | None = None
    ) -> StoreResult:
        return await self._run(
            lambda s: ops.store(in_session(s), ns, keys, data, blocks), StoreResult.all_dropped(len(keys)), session=True
        )

    async def load(self, ns: Namespace, keys: Sequence[bytes], out: Any) -> int:
        return await self._run(lambda s: ops.load(in_session(s), ns, keys, out), fallback=0, session=True)

    async def register_region(self, path_or_fd: str | os.PathLike | int, name: str | None = None) -> Region:
        region = self._open_region(path_or_fd, name)
        try:
            await self._run(lambda _s: ops.nothing(), fallback=None, session=True)
            if region.refused is not None:
                raise region.refused
        except KvstoredError:  # refused: forget it, or every later call fails too
            self._forget_region(region)
            raise
        return region

    async def store_from_region(
        self,
        ns: Namespace,
        region: Region,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        blocks: Sequence[BlockIdentity | None] | None = None,
    ) -> StoreResult:
        return await self._run(
            lambda s: ops.store_from_region(in_session(s), ns, region, keys, offsets, blocks),
            StoreResult.all_dropped(len(keys)),
            session=True,
        )

    async def load_to_region(self, ns: Namespace, region: Region, keys: Sequence[bytes], offsets: Sequence[int]) -> int:
        return await self._run(
            lambda s: ops.load_to_region(in_session(s), ns, region, keys, offsets), fallback=0, session=True
        )

    async def delete(self, ns: Namespace, keys: Sequence[bytes]) -> int:
        return await self._run(lambda s: ops.delete(ns, keys, s), fallback=RAISE, session=ns.private)

    async def stats(self) -> pb.StatsResponse:
        return await self._run(lambda _s: ops.stats(), fallback=RAISE)

    async def health(self) -> Health:
        """Client.health() for asyncio: the daemon's standard health check; never raises."""
        self._check_fork()
        async with self._lock:
            check = self._get_channel().unary_unary(
                HEALTH_CHECK, request_serializer=encode_health_request, response_deserializer=decode_health_response
            )
            try:
                return self._health_of(await check(None, timeout=self.deadline_s), None)
            except grpc.RpcError as exc:
                return self._health_of(None, exc)

    async def _run(self, build: Callable[[PoolSession | None], ops.Op], fallback: Any, session: bool = False) -> Any:
        deadline = time.monotonic() + self.deadline_s
        self._check_fork()
        async with self._lock:
            return await self._drive(self._plan(build, fallback, session), deadline)

    def _new_transport(self) -> None:
        self._lock = asyncio.Lock()
        self._channel = self._stub = None

    def _get_channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(channel_target(self.socket), options=CHANNEL_OPTIONS)
        return self._channel

    def _get_stub(self) -> pb_grpc.KVStoreStub:
        if self._stub is None:
            self._stub = pb_grpc.KVStoreStub(self._get_channel())
        return self._stub

    async def _drive(self, plan: Plan, deadline: float) -> Any:
        stub = self._get_stub()
        try:
            effect = next(plan)
            while True:
                result: Any = None
                try:
                    if effect is OPEN_SESSION:
                        # Off the loop (socket work, populating the pool mapping); a cancelled
                        # caller still waits for it, or the next call would open a second one.
                        timeout = _remaining(deadline)
                        result = await _to_the_end(asyncio.to_thread(self._session_step, timeout))
                    elif isinstance(effect, ops.Settle):
                        pass  # (this client posts nothing: every answer is awaited)
                    elif isinstance(effect, (ops.MapArena, ops.MapIndex)):  # socket work, off the loop
                        try:
                            await _to_the_end(asyncio.to_thread(effect.run, _remaining(deadline)))
                        except Unavailable as exc:
                            raise self._set_up_failed(exc, deadline) from None
                    elif isinstance(effect, ops.Copy):
                        if effect.nbytes < OFF_LOOP_COPY_BYTES:
                            effect.run()
                        else:
                            await _to_the_end(asyncio.to_thread(effect.run))
                    elif effect.copy_grace_s:  # a region transfer: once sent, the daemon may be copying
                        result = await _to_the_end(self._send(stub, effect, deadline))
                    else:
                        result = await self._send(stub, effect, deadline)
                except BaseException as exc:  # a cancellation is re-raised
                    effect = self._failed(plan, effect, exc)
                else:
                    effect = plan.send(result)
        except StopIteration as stop:
            return stop.value

    async def _send(self, stub: Any, effect: ops.Call, deadline: float) -> Any:
        """One call: over the fast path where it can go, else over gRPC."""
        result = await self._fast_call(effect, deadline)
        if result is None:
            result = await self._call(getattr(stub, effect.method), effect, deadline)
        return result

    async def _fast_call(self, effect: ops.Call, deadline: float) -> Any | None:
        """Client._fast_call for asyncio."""
        session = self._session
        if not self.fast_path or session is None or session.fast is None or not session.fast.serves(effect.method):
            return None
        link = session.fast
        request, timeout = _bounded(effect, deadline)
        try:
            return await link.call_async(effect.method, request, timeout)
        except KvstoredError as exc:
            raise self._fast_failed(effect, exc, link) from None
        finally:
            if link.broken:  # an answer may still come: never use this session again
                self._drop_session()

    async def _call(self, method: Any, effect: ops.Call, deadline: float) -> Any:
        request, timeout = _bounded(effect, deadline)
        try:
            return await method(request, timeout=timeout)
        except grpc.RpcError as exc:
            if not self._retry_when_ready(effect, exc):
                raise
            request, timeout = _bounded(effect, deadline)
            return await method(request, timeout=timeout, wait_for_ready=True)


async def _to_the_end(work: Awaitable[Any]) -> Any:
    """Await work; if the caller is cancelled meanwhile, still wait for it to end (it writes pool
    slots or a region that are given back or reused right after), then re-raise the cancellation."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError()
    return task.result()
