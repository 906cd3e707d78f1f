# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""S3 tier: one object per chunk in an S3-compatible store (AWS S3, Ceph radosgw, moto...).

Objects are named like the fs tier's files, `<prefix><ns>/<k0k1>/<k2k3>/<key hex>.kv`, and hold the
same bytes: the 4096-byte chunkfile header, then the payload. Everything read is verified before
a byte reaches the caller's views; a corrupt or truncated object is counted and deleted.

One aiobotocore client (opened in start(), closed in close()) runs on the daemon's loop, with
botocore's own retries off: every request goes through `_call`, which applies
- a semaphore of `max_concurrency` requests (the client's connection pool has as many slots);
- bounded retries with exponential backoff and jitter on throttling, 5xx and dropped connections,
  all within `timeout_s` per operation;
- a circuit breaker: after `breaker_failures` consecutive operations that could not reach the
  endpoint (or were still throttled after every retry), calls fail at once for `breaker_reset_s`,
  then one probe goes through, checking the bucket first. A dead endpoint costs one timeout, not
  one per lookup.
contains() answers from an index of objects known to exist (written, read or seen by this daemon)
and a short-lived negative cache, and HEADs the rest concurrently. With a capacity, the index is
also the LRU order: it is rebuilt from a listing of the prefix at start, and writes delete the
least recently used objects to stay within the capacity.
The CPU work on a chunk (checksum and copy into one PUT body; verify and copy a GET body into the
pool) runs in a small thread pool of the tier's own, as the fs tier's does: never on the loop.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import functools
import io
import logging
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from kvstored.chunks import chunkfile
from kvstored.chunks.chunkfile import HEADER_BYTES
from kvstored.chunks.ids import ChunkId, RemovalCause, TierKind
from kvstored.chunks.receiver import RecordReceiver
from kvstored.chunks.views import trim
from kvstored.errors import TierUnavailable
from kvstored.io.breaker import CircuitBreaker, Permit
from kvstored.sizes import format_size
from kvstored.tiers.base import AdmissionPolicy, SecondaryTier, TierUsage, WriteOutcome
from kvstored.tiers.capacity import CapacityIndex
from kvstored.tiers.resilience import Backoff, NegativeCache

log = logging.getLogger(__name__)
DEFAULT_BACKOFF = Backoff()

T = TypeVar("T")
CPU_THREADS = 2  # chunk encode/verify/copy: ~0.3 ms per 2 MiB each, a thread keeps up with many PUTs
WARMUP_KEY = "_kvstored/warmup"  # under the prefix; never a chunk name (those end in .kv)
_UNBOUNDED = sys.maxsize
_THROTTLED_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestTimeout",
        "ServiceUnavailable",
        "InternalError",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
# A HEAD answers 403 without a code; the others come with a body.
_CREDENTIAL_CODES = frozenset(
    {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}
)
CREDENTIALS_HINT = (
    " (credentials refused: check access_key/secret_key, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the environment)"
)


class S3TierError(Exception):
    """The tier cannot work as configured (credentials, bucket): raised by start()."""


class Fault(enum.Enum):
    NOT_FOUND = "not found"  # the endpoint answered: no such object
    REJECTED = "rejected"  # the endpoint answered with an error retrying won't fix (4xx)
    THROTTLED = "throttled"  # SlowDown, 503, other 5xx, RequestTimeout: retried
    UNREACHABLE = "unreachable"  # no answer: refused, reset, timed out: retried

    @property
    def answered(self) -> bool:
        """The endpoint is up (for the circuit breaker)."""
        return self in (Fault.NOT_FOUND, Fault.REJECTED)


class S3Failure(Exception):
    def __init__(self, fault: Fault, detail: str) -> None:
        super().__init__(f"{fault.value}: {detail}")
        self.fault = fault
        self.detail = detail  # the S3 error code, when there is one


class _Skipped(Exception):
    """The circuit breaker is open (or the tier closed): no request was sent."""


def classify(exc: BaseException) -> S3Failure | None:
    """What a request's exception means; None for exceptions that are not S3/transport errors."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _NOT_FOUND_CODES or (status == 404 and code != "NoSuchBucket"):
            return S3Failure(Fault.NOT_FOUND, code or "404")
        if code in _THROTTLED_CODES or status >= 500 or status == 429:
            return S3Failure(Fault.THROTTLED, code or str(status))
        return S3Failure(Fault.REJECTED, code or str(status))
    if isinstance(exc, NoCredentialsError):
        return S3Failure(Fault.REJECTED, str(exc))
    if isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError, aiohttp.ClientError, OSError)):
        # connection refused/reset, connect/read timeouts (TimeoutError is an OSError)
        return S3Failure(Fault.UNREACHABLE, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    if isinstance(exc, BotoCoreError):
        return S3Failure(Fault.REJECTED, f"{type(exc).__name__}: {exc}")
    return None


@dataclass(frozen=True)
class _DeleteClaim:
    chunk: ChunkId
    done: asyncio.Future  # resolved when this DELETE has ended (or was abandoned)
    after: asyncio.Future | None  # an earlier DELETE of the same chunk, which goes first


@dataclass(frozen=True)
class _Received:
    """A GET of a chunk's record into the caller's views."""

    length: int  # the object's (or the range's) length, as the server answered
    read: bool  # False: that length was wrong and the body was not read
    problem: str | None  # None: the views hold the chunk's verified payload


PREFLIGHT_S = 5.0  # the most the check before populating waits for an endpoint (timeout_s if less)
CLAIMS_REMEMBERED = 4096  # recent DELETE claims remembered per chunk (see S3Tier._may_index)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class S3Tier(SecondaryTier):
    """Counters: lookups/hits per chunk asked of contains(); reads/read_bytes per verified chunk
    served; writes/written_bytes per chunk written (payload bytes); evictions per object deleted
    for capacity; errors per failed operation (misses are not errors). `requests` counts HTTP requests
    sent (retries included); `skipped` counts operations refused by the open circuit breaker."""

    kind = TierKind.S3

    def __init__(
        self,
        name: str,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        capacity_bytes: int = 0,
        max_concurrency: int = 16,
        timeout_s: float = 5.0,
        negative_cache_s: float = 1.0,
        breaker_failures: int = 3,
        breaker_reset_s: float = 5.0,
        create_bucket: bool = True,
        admission: AdmissionPolicy = AdmissionPolicy.ALWAYS,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        super().__init__(name)
        if max_concurrency < 1 or timeout_s <= 0 or capacity_bytes < 0:
            raise ValueError("s3 tier needs max_concurrency >= 1, timeout_s > 0 and capacity_bytes >= 0")
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.capacity_bytes = capacity_bytes
        self._region = region
        self._credentials = {"aws_access_key_id": access_key, "aws_secret_access_key": secret_key}
        self._max_concurrency = max_concurrency
        self._timeout_s = timeout_s
        self._create_bucket = create_bucket
        self._backoff = backoff
        self._breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self._missing = NegativeCache(negative_cache_s)
        # Chunks whose DELETE failed: the object may still be there, but it must not be found
        # (the chunk was deleted or evicted) until a PUT replaces it or a DELETE succeeds.
        self._undeleted: set[ChunkId] = set()
        self._index = CapacityIndex(capacity_bytes or _UNBOUNDED, admission)  # objects known to exist, LRU first
        self._slots = asyncio.Semaphore(max_concurrency)
        self._pending: dict[ChunkId, asyncio.Future] = {}  # writes in flight -> their WriteOutcome
        self._deleting: dict[ChunkId, asyncio.Future] = {}  # deletes in flight
        # A GET or HEAD that answered before a DELETE claimed since it was sent must not index
        # the chunk again: the epoch of each chunk's last claim (the oldest forgotten ones count
        # as `_forgotten_epoch`).
        self._delete_epoch = 0
        self._claimed_at: OrderedDict[ChunkId, int] = OrderedDict()
        self._forgotten_epoch = 0
        self._cpu = ThreadPoolExecutor(max_workers=CPU_THREADS, thread_name_prefix=f"kvstored-s3-{name}")
        self._cpu_jobs: set[asyncio.Future] = set()  # close() waits for them
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._ready = False  # bucket checked: again after each outage (probe), lazily if start() could not
        self._bucket_checked = False  # by preflight(): start() goes on from there
        self._unreachable_at_start: S3Failure | None = None  # what preflight() met, if the endpoint was down
        self._listed = False  # the prefix listed into the index (with a capacity)
        self._closed = False
        self.requests = 0
        self.skipped = 0

    @property
    def available(self) -> bool:
        """False while the circuit breaker refuses calls (the endpoint looked dead)."""
        return not self._closed and self._client is not None and self._breaker.would_allow()

    # -- lifecycle ------------------------------------------------------------------------

    async def preflight(self) -> str:
        """Open the client and check (or create) the bucket with its credentials, before the
        daemon populates its RAM tier. Refused credentials or a missing bucket raise
        (S3TierError); an endpoint that does not answer does not: the daemon starts without the
        tier, whose breaker probes it every breaker_reset_s (an outage at start is an outage)."""
        await self._open()
        where = f"bucket {self.bucket!r} at {self.endpoint_url or 'AWS'}"
        try:
            async with asyncio.timeout(min(self._timeout_s, PREFLIGHT_S)):
                await self._check_bucket()
        except TimeoutError:
            exc = S3Failure(Fault.UNREACHABLE, f"no answer within {min(self._timeout_s, PREFLIGHT_S):g} s")
            self._unreachable_at_start = exc
            return f"{where} unreachable ({exc}): starting without it, probed every {self._breaker.reset_s:g} s"
        except S3Failure as exc:
            if exc.fault.answered:
                await self._refuse(exc)
            self._unreachable_at_start = exc
            return f"{where} unreachable ({exc}): starting without it, probed every {self._breaker.reset_s:g} s"
        except BaseException:
            await self.close()
            raise
        self._bucket_checked = True
        return f"{where}: credentials and bucket checked"

    async def start(self) -> None:
        """Open the client, check (or create) the bucket (unless preflight did), warm it up and,
        with a capacity, list the prefix to rebuild the index. An unreachable endpoint is not
        fatal: the breaker opens and the first probe after breaker_reset_s finishes the set-up.
        Bad credentials or a missing bucket are (S3TierError)."""
        if self._client is None:
            await self._open()
        failure = self._unreachable_at_start
        try:
            if failure is None:
                await self._setup(bucket_checked=self._bucket_checked)
        except S3Failure as exc:
            if exc.fault.answered:
                await self._refuse(exc)
            failure = exc
        except BaseException:
            await self.close()
            raise
        if failure is not None:
            self._breaker.trip()
            log.warning(
                "s3 tier %s: %s unreachable at start (%s); retrying in %.1f s",
                self.name,
                self.endpoint_url or "S3",
                failure,
                self._breaker.reset_s,
            )
            return
        victims = self._index.shrink_to_capacity()  # the listing found more than the capacity
        if victims:
            await self._evict(self._claim_deletes(victims))
        log.info(
            "s3 tier %s: bucket %s prefix %r at %s: %d objects, %s known (capacity %s)",
            self.name,
            self.bucket,
            self.prefix,
            self.endpoint_url or "AWS",
            len(self._index),
            format_size(self._index.used_bytes),
            format_size(self.capacity_bytes) if self.capacity_bytes else "unbounded",
        )

    async def _open(self) -> None:
        config = AioConfig(
            connect_timeout=min(self._timeout_s, 2.0),
            read_timeout=self._timeout_s,
            retries={"total_max_attempts": 1},  # our policy (_retrying) governs
            max_pool_connections=self._max_concurrency,
            tcp_keepalive=True,
            # Chunks carry their own xxh3, verified on every read: no CRC32 or SHA-256 of the body
            # on top (botocore would otherwise hash each PUT body once or twice on the loop).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"payload_signing_enabled": False, **({"addressing_style": "path"} if self.endpoint_url else {})},
        )
        self._stack = AsyncExitStack()
        self._client = await self._stack.enter_async_context(
            get_session().create_client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self._region,
                config=config,
                **self._credentials,
            )
        )

    async def _refuse(self, exc: S3Failure) -> NoReturn:
        """The endpoint answered that this tier cannot work (credentials, bucket): close, raise."""
        await self.close()
        hint = CREDENTIALS_HINT if exc.detail in _CREDENTIAL_CODES else ""
        raise S3TierError(
            f"s3 tier {self.name}: bucket {self.bucket!r} at {self.endpoint_url or 'AWS'} is not usable: {exc}{hint}"
        ) from exc

    async def close(self) -> None:
        self._closed = True
        self._cpu.shutdown(wait=False)  # no new jobs; those running end below
        while self._cpu_jobs:
            await asyncio.wait(list(self._cpu_jobs))
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()

    async def _setup(self, bucket_checked: bool = False) -> None:
        """Bucket check/creation, a warm-up PUT (radosgw makes its data pool on the first one),
        and with a capacity the listing (an index over the capacity shrinks on the next write)."""
        if not bucket_checked:
            await self._check_bucket()
        if not self._listed:
            await self._rebuild()
        self._ready = True

    async def _rebuild(self) -> None:
        """With a capacity, the index from a listing of the prefix (once: the tier keeps it after)."""
        if self.capacity_bytes:
            await self._list()
            self._listed = True

    async def _check_bucket(self) -> None:
        try:
            await self._retrying(lambda: self._client.head_bucket(Bucket=self.bucket))
        except S3Failure as exc:
            if exc.fault is not Fault.NOT_FOUND:
                raise
            if not self._create_bucket:
                raise S3Failure(Fault.REJECTED, "NoSuchBucket") from None
            await self._retrying(self._make_bucket)
        warmup = self.prefix + WARMUP_KEY
        await self._retrying(lambda: self._client.put_object(Bucket=self.bucket, Key=warmup, Body=b""))
        await self._retrying(lambda: self._client.delete_object(Bucket=self.bucket, Key=warmup))

    async def _make_bucket(self) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self._region and self._region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self._region}
        try:
            await self._client.create_bucket(**kwargs)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                raise

    async def _list(self) -> None:
        found: list[tuple[ChunkId, int, float]] = []
        token: str | None = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self.prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = await self._retrying(functools.partial(self._client.list_objects_v2, **kwargs))
            for obj in page.get("Contents", ()):
                chunk = chunkfile.parse_relpath(obj["Key"][len(self.prefix) :])
                if chunk is not None:
                    found.append((chunk, int(obj["Size"]), obj["LastModified"].timestamp()))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        self._index.load(found)  # oldest LastModified first = least recently used

    # -- SecondaryTier ----------------------------------------------------------------------

    def holds(self, chunks: Sequence[ChunkId]) -> list[bool]:
        """Objects the index knows to exist (written or listed by this daemon), while the endpoint
        is usable: with the breaker open a load could not bring them up."""
        if not self.available:
            return [False] * len(chunks)
        return [chunk not in self._undeleted and self._index.touch(chunk) is not None for chunk in chunks]

    async def contains(self, chunks: Sequence[ChunkId]) -> list[bool]:
        out = [False] * len(chunks)
        self.counters.lookups += len(chunks)
        if not self.available:
            self.skipped += 1
            return out
        ask: dict[ChunkId, list[int]] = {}
        for i, chunk in enumerate(chunks):
            if self._index.touch(chunk) is not None:
                out[i] = True
            elif chunk not in self._missing and chunk not in self._pending and chunk not in self._undeleted:
                ask.setdefault(chunk, []).append(i)
        if ask:
            async with asyncio.TaskGroup() as group:
                heads = [group.create_task(self._head(chunk)) for chunk in ask]
            for positions, head in zip(ask.values(), heads):
                for i in positions:
                    out[i] = head.result()
        self.counters.hits += sum(out)
        return out

    async def write(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> WriteOutcome:
        if self._index.touch(chunk) is not None:
            return WriteOutcome.ALREADY_PRESENT
        pending = self._pending.get(chunk)
        if pending is not None:  # the same bytes are on their way: share that write's outcome
            outcome = await asyncio.shield(pending)
            return WriteOutcome.ALREADY_PRESENT if outcome is WriteOutcome.WRITTEN else outcome
        if not self.available:
            self.skipped += 1
            return WriteOutcome.FAILED
        if not self._index.admit(chunk):
            self.counters.rejected_admission += 1
            return WriteOutcome.REJECTED_ADMISSION
        reservation = self._index.reserve(HEADER_BYTES + size)
        if not reservation.granted:
            self.counters.rejected_full += 1
            return WriteOutcome.REJECTED_FULL
        # The victims left the index just now: claim their deletes at once, so a write of one of
        # them waits for its DELETE instead of being deleted by it.
        victims = self._claim_deletes(reservation.victims)
        done = asyncio.get_running_loop().create_future()
        self._pending[chunk] = done
        outcome = WriteOutcome.FAILED
        try:
            outcome = await self._put(chunk, views, size, victims)
            return outcome
        finally:
            self._index.release(reservation)
            del self._pending[chunk]
            done.set_result(outcome)

    async def read(self, chunk: ChunkId, views: Sequence[memoryview], size: int) -> bool:
        targets = trim(views, size)
        if chunk in self._undeleted:
            return False
        if not self.available:
            self.skipped += 1
            return False
        key = self._key(chunk)
        epoch = self._delete_epoch
        try:
            got = await self._call(lambda: self._receive(key, RecordReceiver(chunk, size, targets)))
        except _Skipped:
            return False
        except S3Failure as exc:
            if exc.fault is Fault.NOT_FOUND:
                self._index.discard(chunk)  # deleted behind our back (another daemon, a lifecycle rule)
                self._missing.add(chunk)
            else:
                self._failed("read", key, exc)
            return False
        if (problem := got.problem) is not None:
            self.counters.checksum_failures += 1
            log.warning("s3 tier %s: corrupt object %s deleted: %s", self.name, key, problem)
            self._index.discard(chunk)
            self.notify_removed(chunk, RemovalCause.CORRUPT)
            await self._delete(chunk)
            return False
        self.counters.reads += 1
        self.counters.read_bytes += size
        if self._index.touch(chunk) is None and self._may_index(chunk, epoch):
            self._index.insert(chunk, got.length, time.time())
        return True

    async def remove(self, chunk: ChunkId) -> bool:
        """Delete the object; True once it is gone. False if the DELETE failed, or if the chunk is
        not indexed and was just seen missing (then nothing is sent)."""
        pending = self._pending.get(chunk)
        if pending is not None:  # let the write land, then remove what it wrote
            await asyncio.wait((pending,))
        known = self._index.discard(chunk) is not None
        if not known and chunk in self._missing:
            return False
        if not await self._delete(chunk):
            raise TierUnavailable(
                f"s3 tier {self.name}: could not delete {self._key(chunk)}; it will not be served, retry the delete"
            )
        return True

    def known_chunks(self, namespace_id: str) -> list[ChunkId]:
        return self._index.chunks_of(namespace_id)

    async def namespace_chunks(self, namespace_id: str) -> list[ChunkId]:
        """The namespace's objects under the prefix (a listing: without a capacity the index
        holds only the objects this daemon has seen), and those in flight."""
        found: dict[ChunkId, None] = dict.fromkeys(self._index.chunks_of(namespace_id))
        found.update(dict.fromkeys(c for c in self._pending if c[0] == namespace_id))
        ns_prefix = f"{self.prefix}{namespace_id}/"
        for key, _size in await self._guarded("list", ns_prefix, self._list_keys(ns_prefix)):
            chunk = chunkfile.parse_relpath(key[len(self.prefix) :])
            if chunk is not None and chunk[0] == namespace_id:
                found[chunk] = None
        return list(found)

    async def save_namespace_record(self, namespace_id: str, record: bytes) -> None:
        key = self.prefix + chunkfile.record_relpath(namespace_id)
        await self._guarded(
            "write", key, self._call(lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=record))
        )

    async def remove_namespace_record(self, namespace_id: str) -> None:
        key = self.prefix + chunkfile.record_relpath(namespace_id)
        await self._guarded("delete", key, self._call(lambda: self._client.delete_object(Bucket=self.bucket, Key=key)))

    async def namespace_records(self) -> dict[str, bytes]:
        records_prefix = f"{self.prefix}{chunkfile.RECORDS_DIR}/"
        names = {}
        for key, size in await self._guarded("list", records_prefix, self._list_keys(records_prefix)):
            namespace_id = chunkfile.parse_record_name(key[len(records_prefix) :])
            if namespace_id is not None and size <= chunkfile.MAX_RECORD_BYTES:
                names[namespace_id] = key
        bodies = await asyncio.gather(
            *(self._guarded("read", key, self._call(functools.partial(self._read_all, key))) for key in names.values())
        )
        return dict(zip(names, bodies))

    async def _read_all(self, key: str) -> bytes:
        response = await self._client.get_object(Bucket=self.bucket, Key=key)
        async with response["Body"] as stream:
            return await stream.read()

    async def _list_keys(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of every object under `prefix`, page after page (under the breaker)."""
        found: list[tuple[str, int]] = []
        token: str | None = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = await self._call(functools.partial(self._client.list_objects_v2, **kwargs))
            found += [(obj["Key"], int(obj["Size"])) for obj in page.get("Contents", ())]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found

    async def _guarded(self, what: str, key: str, work: Awaitable[T]) -> T:
        """`work`, with its S3 failure (or the open breaker) raised as TierUnavailable naming it."""
        try:
            return await work
        except _Skipped:
            raise TierUnavailable(
                f"s3 tier {self.name}: cannot {what} {key}: {self.endpoint_url or 'S3'} is not answering"
            ) from None
        except S3Failure as exc:
            raise TierUnavailable(f"s3 tier {self.name}: cannot {what} {key}: {exc}") from None

    def usage(self) -> TierUsage:
        return TierUsage(self.capacity_bytes, self._index.used_bytes, len(self._index))

    def set_admission(self, policy: AdmissionPolicy) -> None:
        self._index.admission = policy

    # -- operations ---------------------------------------------------------------------------

    def _key(self, chunk: ChunkId) -> str:
        return self.prefix + chunkfile.chunk_relpath(chunk)

    async def _head(self, chunk: ChunkId) -> bool:
        key = self._key(chunk)
        epoch = self._delete_epoch
        try:
            head = await self._call(lambda: self._client.head_object(Bucket=self.bucket, Key=key))
        except _Skipped:
            return False
        except S3Failure as exc:
            if exc.fault is Fault.NOT_FOUND:
                if chunk not in self._index and chunk not in self._pending:
                    self._missing.add(chunk)
            else:
                self._failed("look up", key, exc)
            return False
        if chunk not in self._index and self._may_index(chunk, epoch):  # written by another daemon
            self._index.insert(chunk, int(head.get("ContentLength", 0)), time.time())
        return True

    def _may_index(self, chunk: ChunkId, epoch: int) -> bool:
        """Whether an object seen by a request sent at `epoch` may be indexed: no write of it is
        in flight (that one indexes it), and no DELETE of it (removal, eviction) was claimed since
        or is under way: the object the request saw is gone or about to be."""
        if chunk in self._pending or chunk in self._deleting or chunk in self._undeleted or chunk in self._missing:
            return False
        return self._forgotten_epoch <= epoch and self._claimed_at.get(chunk, 0) <= epoch

    async def _receive(self, key: str, receiver: RecordReceiver, start: int | None = None) -> _Received:
        """GET the object `key` (or its record at `start`) into the receiver's views, verified:
        the body is never held whole (one copy of each byte, on the loop, as it arrives). A new
        receiver per attempt: a retry starts over."""
        expected = receiver.expected
        ranged = {} if start is None else {"Range": f"bytes={start}-{start + expected - 1}"}
        response = await self._client.get_object(Bucket=self.bucket, Key=key, **ranged)
        async with response["Body"] as body:  # closes the connection if the body is left unread
            length = int(response["ContentLength"])
            if start is not None:
                check_range(response, start, expected)
            if length != expected:
                return _Received(length, False, f"object is {length} bytes, expected {expected}")
            await _stream_into(body, receiver)
            return _Received(length, True, receiver.problem())

    async def _put(
        self, chunk: ChunkId, views: Sequence[memoryview], size: int, victims: list[_DeleteClaim]
    ) -> WriteOutcome:
        key = self._key(chunk)
        parts = trim(views, size)
        try:
            header = await self._off_loop(_header, chunk, parts, size)
            while (prior := self._deleting.get(chunk)) is not None:  # an eviction/removal of the old copy
                await asyncio.wait((prior,))
        except _Skipped:  # closed meanwhile
            return WriteOutcome.FAILED
        finally:
            if victims:  # out of the index already: their objects go whatever happens here
                await self._evict(victims)
        try:
            # (from the chunk's pages: they do not change while it is written down)
            await self._call(
                lambda: self._client.put_object(Bucket=self.bucket, Key=key, Body=PartsStream([header, *parts]))
            )
        except _Skipped:
            return WriteOutcome.FAILED
        except S3Failure as exc:
            self._failed("write", key, exc)
            return WriteOutcome.FAILED
        self._index.insert(chunk, HEADER_BYTES + size, time.time())
        self._missing.discard(chunk)
        self._undeleted.discard(chunk)
        self.counters.writes += 1
        self.counters.written_bytes += size
        return WriteOutcome.WRITTEN

    def _claim_deletes(self, victims: Sequence[tuple[ChunkId, object]]) -> list[_DeleteClaim]:
        return [self._claim_delete(chunk) for chunk, _entry in victims]

    def _claim_delete(self, chunk: ChunkId) -> _DeleteClaim:
        """Register a DELETE of `chunk` now (it runs after any earlier one): writes of the chunk
        wait for it from this moment, not only once the DELETE is sent."""
        claim = _DeleteClaim(chunk, asyncio.get_running_loop().create_future(), self._deleting.get(chunk))
        self._deleting[chunk] = claim.done
        self._delete_epoch += 1
        self._claimed_at[chunk] = self._delete_epoch
        self._claimed_at.move_to_end(chunk)
        while len(self._claimed_at) > CLAIMS_REMEMBERED:
            _chunk, forgotten = self._claimed_at.popitem(last=False)
            self._forgotten_epoch = max(self._forgotten_epoch, forgotten)
        return claim

    async def _delete(self, chunk: ChunkId, claim: _DeleteClaim | None = None) -> bool:
        claim = claim or self._claim_delete(chunk)
        key = self._key(chunk)
        try:
            if claim.after is not None:
                await asyncio.wait((claim.after,))
            await self._call(lambda: self._client.delete_object(Bucket=self.bucket, Key=key))
        except _Skipped:
            self._undeleted.add(chunk)
            return False
        except S3Failure as exc:
            if exc.fault is not Fault.NOT_FOUND:
                self._failed("delete", key, exc)
                self._undeleted.add(chunk)
                return False
        finally:
            self._settle_delete(claim)
        self._missing.add(chunk)
        self._undeleted.discard(chunk)
        return True

    def _settle_delete(self, claim: _DeleteClaim) -> None:
        if self._deleting.get(claim.chunk) is claim.done:
            del self._deleting[claim.chunk]
        if not claim.done.done():
            claim.done.set_result(None)

    async def _evict(self, victims: list[_DeleteClaim]) -> None:
        self.counters.evictions += len(victims)
        for claim in victims:
            self.notify_removed(claim.chunk, RemovalCause.EVICTED)
        try:
            await asyncio.gather(*(self._delete(claim.chunk, claim) for claim in victims), return_exceptions=True)
        finally:  # a DELETE cancelled before it ran must not leave writes of its chunk waiting forever
            for claim in victims:
                self._settle_delete(claim)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the tier's threads (raises _Skipped once the tier is closed). Waits for
        the job to end even if the caller is cancelled meanwhile (then re-raises the
        cancellation): the job reads or writes the caller's views, whose pages the chain reuses
        as soon as the caller returns."""
        loop = asyncio.get_running_loop()
        try:
            job = loop.run_in_executor(self._cpu, fn, *args)
        except RuntimeError:  # the pool is shut down: close() ran
            raise _Skipped from None
        self._cpu_jobs.add(job)
        job.add_done_callback(self._cpu_jobs.discard)
        cancelled = False
        while not job.done():
            try:
                await asyncio.wait((job,))
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError()
        return job.result()

    def _failed(self, what: str, key: str, exc: S3Failure) -> None:
        self.counters.errors += 1
        level = logging.DEBUG if exc.fault is Fault.UNREACHABLE else logging.WARNING
        log.log(level, "s3 tier %s: cannot %s %s: %s", self.name, what, key, exc)

    # -- requests: breaker, retries, deadline ----------------------------------------------

    async def _call(self, request: Callable[[], Awaitable[T]]) -> T:
        """One operation under the circuit breaker (raises _Skipped when it is open)."""
        permit = None if self._closed or self._client is None else self._breaker.allow()
        if permit is None:
            self.skipped += 1
            raise _Skipped
        verdict: bool | None = None
        try:
            if not self._ready:
                await self._setup()
            result = await self._retrying(request)
            verdict = True
            return result
        except S3Failure as exc:
            verdict = exc.fault.answered
            if exc.detail == "NoSuchBucket":
                self._ready = False  # deleted behind our back: the next call recreates it
            raise
        finally:
            self._settle(permit, verdict)

    def _settle(self, permit: Permit, verdict: bool | None) -> None:
        if verdict is None:  # cancelled
            self._breaker.abandon(permit)
            return
        opened = self._breaker.times_opened
        self._breaker.record(permit, verdict)
        if self._breaker.times_opened != opened:
            self._ready = False  # the probe checks the bucket again (it may have lost its data)
            log.warning(
                "s3 tier %s: %s is not answering; its calls fail at once for %.1f s at a time",
                self.name,
                self.endpoint_url or "S3",
                self._breaker.reset_s,
            )
        elif verdict and permit.probe:
            log.warning("s3 tier %s: %s answers again", self.name, self.endpoint_url or "S3")

    async def _retrying(self, request: Callable[[], Awaitable[T]]) -> T:
        """Send `request` (again) until it succeeds, a retry would not help, the attempts are
        spent or `timeout_s` has passed since the first attempt."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        attempt = 0
        while True:
            async with self._slots:
                if deadline is None:
                    deadline = loop.time() + self._timeout_s
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise S3Failure(Fault.UNREACHABLE, f"no answer within {self._timeout_s} s")
                self.requests += 1
                try:
                    async with asyncio.timeout(remaining):
                        return await request()
                except Exception as exc:  # noqa: BLE001 - classified below, the rest re-raised
                    failure = classify(exc)
                    if failure is None:
                        raise
            attempt += 1
            if failure.fault.answered or attempt >= self._backoff.attempts:
                raise failure
            delay = self._backoff.delay(attempt - 1)
            if loop.time() + delay >= deadline:
                raise failure
            await asyncio.sleep(delay)


def content_range(response: dict[str, Any]) -> tuple[int, int, int | None] | None:
    """(first, last, object size or None) of a ranged GET's answer; None unless it is a 206 with
    a Content-Range (a server or proxy may ignore Range and answer 200 with the whole object)."""
    if int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0) != 206:
        return None
    match = _CONTENT_RANGE.fullmatch(str(response.get("ContentRange", "")).strip())
    if match is None:
        return None
    total = match.group(3)
    return int(match.group(1)), int(match.group(2)), None if total == "*" else int(total)


def check_range(response: dict[str, Any], start: int, length: int) -> None:
    """Raise (a failed read, not damage) unless the answer is the range asked for, `length` bytes
    from `start`; a shorter one (the object is shorter) is for the caller to judge. A 200 is that
    range when it starts at 0 and is `length` bytes long: the whole object was asked for (HTTP
    lets a server answer such a Range with the whole object)."""
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    if status == 200 and start == 0 and int(response.get("ContentLength", -1)) == length:
        return
    got = content_range(response)
    if got is None or got[0] != start:
        raise S3Failure(
            Fault.REJECTED, f"Range not honoured (HTTP {status}, Content-Range {response.get('ContentRange')})"
        )


# -- a chunk's bytes: encoded in the tier's threads, received on the loop ---------------------


def _encode(chunk: ChunkId, views: Sequence[memoryview], size: int) -> bytes:
    """The object: header + payload, in one buffer (one copy of the payload)."""
    parts = trim(views, size)
    return b"".join([_header(chunk, parts, size), *parts])


def _header(chunk: ChunkId, parts: Sequence[memoryview], size: int) -> bytes:
    """The object's header, with the payload's checksum (a pass over its bytes)."""
    return chunkfile.encode_header(chunk, size, chunkfile.checksum(parts, size))


class PartsStream(io.RawIOBase):
    """A PUT body read from its parts where they are (a chunk's header and pages, a pack's
    records): never joined into one buffer, as a bytes Body would be, then copied again on the
    loop. A new one per attempt, so an attempt given up on never moves the position of the next.
    aiohttp reads it in its executor threads."""

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        super().__init__()
        self._parts = [memoryview(p) for p in parts]
        self._starts: list[int] = []
        offset = 0
        for part in self._parts:
            self._starts.append(offset)
            offset += len(part)
        self._size = offset
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        pieces = []
        i = bisect.bisect_right(self._starts, self._pos) - 1
        while self._pos < end:
            part, start = self._parts[i], self._starts[i]
            take = min(end, start + len(part)) - self._pos
            pieces.append(part[self._pos - start : self._pos - start + take])
            self._pos += take
            i += 1
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


async def _stream_into(body: Any, receiver: RecordReceiver) -> None:
    """Feed a response body to the receiver piece by piece as the connection delivers them:
    aiohttp's buffers as they are (no join), or 1 MiB reads from another HTTP backend."""
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    if isinstance(content, aiohttp.StreamReader):
        while True:
            piece, _ = await content.readchunk()
            if not piece:
                if content.at_eof():
                    return
                continue  # an HTTP chunk boundary: no data
            receiver.feed(piece)
            if receiver.received > receiver.expected:
                return  # more than its length: problem() says so
    while piece := await body.read(1 << 20):
        receiver.feed(piece)
        if receiver.received > receiver.expected:
            return
