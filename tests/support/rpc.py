# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Raw protocol access for tests: gRPC stubs, sessions opened by hand, status assertions."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc

from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.session import PoolSession

__all__ = ["pb", "pb_grpc", "RawConn", "raw", "rpc_error"]

TIMEOUT_S = 10.0


class RawConn:
    """A gRPC stub plus (optionally) an open session on the session socket."""

    def __init__(self, socket: Path, session: bool = True, client_name: str = "raw-test") -> None:
        self.socket = Path(socket)
        self.channel = grpc.insecure_channel(f"unix:{socket}")
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.session = PoolSession.open(self.socket, client_name, TIMEOUT_S) if session else None

    @property
    def session_id(self) -> str:
        assert self.session is not None
        return self.session.session_id

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, timeout=TIMEOUT_S)

    def register(self, model: str, chunk_bytes: int, dtype: str = "uint8", key_bytes: int = 0, layout: str = "") -> str:
        spec = pb.NamespaceSpec(model=model, dtype=dtype, chunk_bytes=chunk_bytes, layout=layout, key_bytes=key_bytes)
        return self.call("RegisterNamespace", pb.RegisterNamespaceRequest(spec=spec)).namespace_id

    def stats(self) -> pb.StatsResponse:
        return self.call("Stats", pb.StatsRequest())

    def acquire(self, namespace_id: str, keys: list[bytes]) -> list:
        return list(
            self.call(
                "Acquire", pb.AcquireRequest(session_id=self.session_id, namespace_id=namespace_id, keys=keys)
            ).leases
        )

    def release(self, handles: list[int]) -> int:
        return self.call("Release", pb.ReleaseRequest(session_id=self.session_id, handles=handles)).released

    def read_extents(self, extents) -> bytes:
        """The pool bytes a lease or reservation points at, in order."""
        assert self.session is not None and self.session.pool is not None
        pool = self.session.pool
        return b"".join(pool[e.offset : e.offset + e.length].tobytes() for e in extents)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        self.channel.close()


@contextlib.contextmanager
def raw(socket: Path | str, session: bool = True) -> Iterator[RawConn]:
    conn = RawConn(Path(socket), session)
    try:
        yield conn
    finally:
        conn.close()


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    """Call fn and return the grpc.RpcError it raises (AssertionError if it succeeds)."""
    try:
        result = fn(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"expected a gRPC error, got {result!r}")


def make_region_file(directory: Path | str, name: str, size: int) -> Path:
    path = Path(directory) / name
    with open(path, "wb") as fh:
        fh.truncate(size)
    os.chmod(path, 0o600)
    return path
