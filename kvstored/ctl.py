# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""`kvstoredctl`: look at and act on a running kvstored over its unix socket.

Tables for people, `--json` for scripts. Exit codes: 0 done, 1 the daemon is unreachable, not
serving or refused the request (one line on stderr naming the socket), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstored import top
from kvstored.sizes import format_size, parse_size
from kvstored.top import drops, kind_name
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.errors import INCARNATION_KEY, OLDEST_SEQ_KEY
from kvstored_client.keys import namespace_id_for
from kvstored_client.kinds import DropReason
from kvstored_client.paths import default_socket_path

PROG = "kvstoredctl"
BATCH_KEYS = 1024  # keys per request; well below the daemon's default max_batch_keys
MAX_KEY_LINE = 1024  # characters in a --keys-file line (a key's hex and its newline fit many times)
DEFAULT_COUNT_WAIT_S = 5.0  # `events --count N`: give up after this long without an event

EPILOG = """\
The socket defaults to $KVSTORED_SOCKET, else /run/kvstored/kvstored.sock as root or
whenever it exists, else $XDG_RUNTIME_DIR/kvstored/kvstored.sock
(/tmp/kvstored-UID/kvstored/kvstored.sock without XDG_RUNTIME_DIR)."""


NEED_GROUP = "run as root or as a member of the socket's group"


class CtlError(Exception):
    """Printed as one line on stderr; exit code 1."""


# -- talking to the daemon ----------------------------------------------------------------------


class Conn:
    def __init__(self, socket: Path, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout
        self._channel: grpc.Channel | None = None

    def _open(self) -> grpc.Channel:
        if self._channel is None:
            try:
                os.stat(self.socket)
            except (FileNotFoundError, NotADirectoryError):
                raise CtlError(
                    f"cannot reach kvstored at {self.socket}: no such socket "
                    f"(is kvstored running? use --socket or KVSTORED_SOCKET)"
                ) from None
            except PermissionError:  # e.g. /run/kvstored is 0750 and we are not in its group
                raise CtlError(
                    f"cannot reach kvstored at {self.socket}: permission denied on {self.socket.parent} ({NEED_GROUP})"
                ) from None
            self._channel = grpc.insecure_channel(f"unix:{self.socket}")
        return self._channel

    @property
    def kv(self) -> pb_grpc.KVStoreStub:
        return pb_grpc.KVStoreStub(self._open())

    def call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.kv, method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self.error(method, exc) from None

    def call_peer(self, method: str, request: Any) -> Any:
        """A call to the daemon's peer control service (kvstored.v1.Peer)."""
        try:
            return getattr(pb_grpc.PeerStub(self._open()), method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self.error(method, exc) from None

    def health(self) -> str:
        stub = health_pb2_grpc.HealthStub(self._open())
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self.error("health check", exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def error(self, what: str, exc: grpc.RpcError) -> CtlError:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            if not os.access(self.socket, os.R_OK | os.W_OK):
                why = f"permission denied ({NEED_GROUP})"
            elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"no answer within {self.timeout:g}s"
            else:
                why = "nothing is serving on it (stale socket?)"
            return CtlError(f"cannot reach kvstored at {self.socket}: {why}")
        return CtlError(f"{what} failed on {self.socket}: {code.name}: {exc.details()}")

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


# -- output -------------------------------------------------------------------------------------


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def tier_dict(t: pb.TierStats) -> dict[str, Any]:
    d = {f.name: getattr(t, f.name) for f in pb.TierStats.DESCRIPTOR.fields}
    d["packs_by_live_quarter"] = list(t.packs_by_live_quarter)
    d["packed_live_ratio"] = ratio(t.packed_live_bytes, t.packed_bytes)
    d["kind"] = kind_name(t.kind)
    d["misses"] = t.lookups - t.hits
    d["hit_ratio"] = ratio(t.hits, t.lookups)
    d["utilization"] = ratio(t.used_bytes, t.capacity_bytes)
    return d


def pack_line(t: pb.TierStats) -> str:
    """A packed tier's objects: how much of their bytes is still live (the rest waits for expiry)."""
    quarters = " / ".join(str(n) for n in t.packs_by_live_quarter)
    return (
        f"{t.name} packs: {t.packs} ({format_size(t.packed_bytes)}), "
        f"{percent(ratio(t.packed_live_bytes, t.packed_bytes))} live; by live share 0-25/25-50/50-75/75-100%: "
        f"{quarters}; written {t.packs_written}, expired {t.packs_expired}, dropped {t.packs_dropped}"
    )


def store_drops(stats: pb.StatsResponse) -> dict[str, int]:
    """Chunks stores dropped since the daemon started, by reason ("ram_full": 4, ...)."""
    known = {int(r): r.label for r in DropReason}
    return {known.get(d.reason, f"reason_{d.reason}"): d.chunks for d in stats.store_drops}


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    print(json.dumps(data, indent=2) if args.json else text())


def hex_keys(args: argparse.Namespace) -> list[bytes]:
    raw = list(args.keys)
    if args.keys_file:
        try:
            with sys.stdin if args.keys_file == "-" else open(args.keys_file) as stream:
                raw += _key_lines(stream, args.keys_file)
        except OSError as exc:
            raise UsageError(f"cannot read --keys-file {args.keys_file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--keys-file {args.keys_file} is not text (hex keys, one per line)") from None
    if not raw:
        raise UsageError("no keys: give hex keys as arguments or with --keys-file")
    keys = []
    for item in raw:
        try:
            keys.append(bytes.fromhex(item))
        except ValueError:
            raise UsageError(f"not a hex key: {item!r}") from None
    return keys


def _key_lines(stream: TextIO, name: str) -> list[str]:
    """The non-empty, non-comment lines; a line longer than any key's hex is refused as it is read
    (a device such as /dev/zero is one endless line)."""
    lines = []
    while line := stream.readline(MAX_KEY_LINE + 1):
        if len(line) > MAX_KEY_LINE:
            raise UsageError(f"--keys-file {name} has a line longer than {MAX_KEY_LINE} characters: not a hex key")
        if line.strip() and not line.startswith("#"):
            lines.append(line.strip())
    return lines


def batches(items: Sequence[bytes], n: int = BATCH_KEYS) -> Iterator[Sequence[bytes]]:
    for start in range(0, len(items), n):
        yield items[start : start + n]


class UsageError(Exception):
    """Bad input: exit code 2."""


def size_arg(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds_arg(value: str) -> float:
    """A finite, positive number of seconds."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {value!r}")
    return seconds


def uint64_arg(value: str) -> int:
    """A count or a sequence number: 0 to 2**64 - 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if not 0 <= number < 1 << 64:
        raise argparse.ArgumentTypeError(f"must be 0 to 2**64 - 1, got {value}")
    return number


# -- commands -----------------------------------------------------------------------------------


def cmd_status(conn: Conn, args: argparse.Namespace) -> int:
    health = conn.health()
    stats = conn.call("Stats", pb.StatsRequest())
    data = {
        "socket": str(conn.socket),
        "health": health,
        "version": stats.version,
        "sessions": stats.sessions,
        "leases": stats.leases,
        "reservations": stats.reservations,
        "regions": stats.regions,
        "namespaces": stats.namespaces,
        "tiers": [tier_dict(t) for t in stats.tiers],
        "staging": {
            "capacity_bytes": stats.staging_capacity_bytes,
            "used_bytes": stats.staging_used_bytes,
            "staged_chunks": stats.staged_chunks,
        },
        "store_drops": store_drops(stats),
    }

    def text() -> str:
        staging = (
            f"staging {format_size(stats.staging_used_bytes)} of {format_size(stats.staging_capacity_bytes)} "
            f"in use, {stats.staged_chunks} chunks loaded through it"
            if stats.staging_capacity_bytes
            else "staging off"
        )
        dropped = "  ".join(f"{reason} {n}" for reason, n in data["store_drops"].items() if n)
        head = (
            f"kvstored {stats.version} on {conn.socket}: {health}\n"
            f"sessions {stats.sessions}  leases {stats.leases}  reservations {stats.reservations}  "
            f"regions {stats.regions}  namespaces {stats.namespaces}  {staging}\n"
            f"chunks dropped by stores: {dropped or 'none'}\n"
        )
        rows = [
            (
                t.name,
                kind_name(t.kind),
                format_size(t.used_bytes),
                format_size(t.capacity_bytes) if t.capacity_bytes else "unbounded",
                percent(ratio(t.used_bytes, t.capacity_bytes)),
                t.chunks,
                percent(ratio(t.hits, t.lookups)),
                t.lookups,
                t.evictions,
                drops(t),
                t.checksum_failures,
                t.queued,
            )
            for t in stats.tiers
        ]
        packed = "".join(f"\n{pack_line(t)}" for t in stats.tiers if t.packs_by_live_quarter)
        return (
            head
            + "\n"
            + table(
                rows,
                (
                    "TIER",
                    "KIND",
                    "USED",
                    "CAPACITY",
                    "UTIL",
                    "CHUNKS",
                    "HIT RATE",
                    "LOOKUPS",
                    "EVICTIONS",
                    "DROPS",
                    "CORRUPT",
                    "QUEUED",
                ),
            )
            + packed
        )

    emit(args, data, text)
    return 0 if health == "SERVING" else 1


def cmd_stats(conn: Conn, args: argparse.Namespace) -> int:
    stats = conn.call("Stats", pb.StatsRequest())
    tiers = [tier_dict(t) for t in stats.tiers]

    def text() -> str:
        fields = [k for k in tiers[0] if k not in ("name", "kind")] if tiers else []
        rows = [["kind"] + [t["kind"] for t in tiers]]
        for field in fields:
            row = [field]
            for t in tiers:
                value = t[field]
                if field in ("hit_ratio", "utilization", "packed_live_ratio"):
                    row.append(percent(value))
                elif field == "packs_by_live_quarter":
                    row.append(" / ".join(map(str, value)) or "-")
                elif field.endswith("_bytes") and value:
                    row.append(f"{value} ({format_size(value)})")
                else:
                    row.append(value)
            rows.append(row)
        return table(rows, ["FIELD"] + [t["name"] for t in tiers])

    emit(args, {"version": stats.version, "tiers": tiers}, text)
    return 0


def cmd_health(conn: Conn, args: argparse.Namespace) -> int:
    status = conn.health()
    emit(args, {"socket": str(conn.socket), "status": status}, lambda: f"{status} ({conn.socket})")
    return 0 if status == "SERVING" else 1


def cmd_lookup(conn: Conn, args: argparse.Namespace) -> int:
    keys = hex_keys(args)
    tiers: list[int] = []
    for batch in batches(keys):
        tiers += conn.call("Lookup", pb.LookupRequest(namespace_id=args.namespace, keys=batch)).tiers
    prefix = next((i for i, t in enumerate(tiers) if not t), len(tiers))
    found = [kind_name(t) if t else None for t in tiers]
    data = {
        "namespace_id": args.namespace,
        "prefix_hits": prefix,
        "hits": sum(1 for f in found if f),
        "keys": [{"key": k.hex(), "tier": f} for k, f in zip(keys, found)],
    }

    def text() -> str:
        rows = [(k.hex(), f or "miss") for k, f in zip(keys, found)]
        return table(rows, ("KEY", "TIER")) + f"\n{data['hits']} of {len(keys)} cached, {prefix} leading (prefix hits)"

    emit(args, data, text)
    return 0


def cmd_evict(conn: Conn, args: argparse.Namespace) -> int:
    keys = hex_keys(args)
    deleted = sum(
        conn.call("Delete", pb.DeleteRequest(namespace_id=args.namespace, keys=batch)).deleted
        for batch in batches(keys)
    )
    emit(
        args,
        {"namespace_id": args.namespace, "requested": len(keys), "deleted": deleted},
        lambda: f"deleted {deleted} of {len(keys)} keys from every tier (namespace {args.namespace})",
    )
    return 0


def cmd_clear(conn: Conn, args: argparse.Namespace) -> int:
    removed = conn.call("ClearNamespace", pb.ClearNamespaceRequest(namespace_id=args.namespace)).removed
    emit(
        args,
        {"namespace_id": args.namespace, "removed": removed},
        lambda: f"removed {removed} chunks of namespace {args.namespace} from every tier",
    )
    return 0


def cmd_namespaces(conn: Conn, args: argparse.Namespace) -> int:
    listed = conn.call("ListNamespaces", pb.ListNamespacesRequest())
    data = [
        {
            "namespace_id": n.namespace_id,
            "model": n.model,
            "dtype": n.dtype,
            "chunk_bytes": n.chunk_bytes,
            "layout": n.layout,
            "key_bytes": n.key_bytes,
            "block_tokens": n.block_tokens,
            "ram_chunks": n.ram_chunks,
            "ram_bytes": n.ram_bytes,
            "quota_bytes": n.quota_bytes,
            "recovered_from": list(n.recovered_from),
        }
        for n in listed.namespaces
    ]
    rows = [
        (
            d["namespace_id"],
            d["model"],
            d["dtype"],
            format_size(d["chunk_bytes"]),
            d["layout"] or "-",
            d["ram_chunks"],
            format_size(d["ram_bytes"]),
            format_size(d["quota_bytes"]) if d["quota_bytes"] else "-",
            "recovered:" + ",".join(d["recovered_from"]) if d["recovered_from"] else "client",
        )
        for d in data
    ]

    def text() -> str:
        listing = table(
            rows, ("NAMESPACE", "MODEL", "DTYPE", "CHUNK", "LAYOUT", "RAM CHUNKS", "RAM", "QUOTA", "SOURCE")
        )
        return (
            f"{listing}\n{listed.tenants} tenant(s) (their namespaces are not shown) hold "
            f"{format_size(listed.tenant_ram_bytes)} of RAM; quota {format_size(listed.tenant_quota_bytes)} each"
        )

    emit(args, data, text)
    return 0


def _peer_name(enum: Any, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()


def cmd_peers(conn: Conn, args: argparse.Namespace) -> int:
    status = conn.call_peer("Status", pb.PeerStatusRequest())
    peers = [
        {
            "address": p.address,
            "state": _peer_name(pb.PeerState, p.state, "PEER_STATE_"),
            "transport": p.transport or None,
            "incarnation": p.incarnation,
            "indexed_chunks": p.indexed_chunks,
            "received_bytes": p.received_bytes,
            "sent_bytes": p.sent_bytes,
            "breaker": _peer_name(pb.BreakerState, p.breaker, "BREAKER_STATE_"),
            "fetches": p.fetches,
            "received_chunks": p.received_chunks,
            "missing_chunks": p.missing_chunks,
            "corrupt_chunks": p.corrupt_chunks,
            "failed_chunks": p.failed_chunks,
            "timed_out_chunks": p.timed_out_chunks,
            "refused_by_breaker": p.refused_by_breaker,
            "events": p.events,
            "resyncs": p.resyncs,
            "detail": p.detail,
        }
        for p in status.peers
    ]
    data = {
        "enabled": status.enabled,
        "incarnation": status.incarnation,
        "transports": list(status.transports),
        "tcp_port": status.tcp_port,
        "ucx_port": status.ucx_port,
        "index_entries": status.index_entries,
        "index_capacity": status.index_capacity,
        "index_evictions": status.index_evictions,
        "leases": status.leases,
        "reservations": status.reservations,
        "served_chunks": status.served_chunks,
        "served_bytes": status.served_bytes,
        "refused_chunks": status.refused_chunks,
        "other_sent_bytes": status.other_sent_bytes,
        "peers": peers,
    }

    def text() -> str:
        if not status.enabled:
            return f'no peer tier on {conn.socket} (configure [[tiers]] kind = "peer")'
        ports = ", ".join(f"{t} port {status.tcp_port if t == 'tcp' else status.ucx_port}" for t in status.transports)
        head = (
            f"serving peers on {ports}; index {status.index_entries} of {status.index_capacity} chunks; "
            f"leased to peers {status.leases}, slots fetching {status.reservations}; "
            f"served {status.served_chunks} chunks ({format_size(status.served_bytes)})\n"
        )
        rows = [
            (
                p["address"],
                p["state"],
                p["transport"] or "-",
                p["indexed_chunks"],
                format_size(p["received_bytes"]),
                format_size(p["sent_bytes"]),
                p["breaker"],
                p["fetches"],
                p["missing_chunks"],
                p["failed_chunks"] + p["timed_out_chunks"],
                p["detail"] or "",
            )
            for p in peers
        ]
        return (
            head
            + "\n"
            + table(
                rows,
                (
                    "PEER",
                    "STATE",
                    "TRANSPORT",
                    "INDEXED",
                    "IN",
                    "OUT",
                    "BREAKER",
                    "FETCHES",
                    "MISSING",
                    "FAILED",
                    "DETAIL",
                ),
            )
        )

    emit(args, data, text)
    return 0


def cmd_directory(conn: Conn, args: argparse.Namespace) -> int:
    status = conn.call_peer("Status", pb.PeerStatusRequest())
    on = status.enabled and status.HasField("directory")
    d = status.directory
    data: dict[str, Any] = {"enabled": on}
    if on:
        data.update(
            {
                "url": d.url,
                "breaker": _peer_name(pb.BreakerState, d.breaker, "BREAKER_STATE_"),
                "shards": list(d.shards),
                "lag_s": d.lag_s,
                "pending_changes": d.pending_changes,
                "found_peers": d.found_peers,
                "lookups": d.lookups,
                "lookup_chunks": d.lookup_chunks,
                "hit_chunks": d.hit_chunks,
                "errors": d.errors,
                "timeouts": d.timeouts,
                "refused": d.refused,
                "write_batches": d.write_batches,
                "write_commands": d.write_commands,
                "write_errors": d.write_errors,
                "refreshed": d.refreshed,
                "dropped_changes": d.dropped_changes,
                "stale_deleted": d.stale_deleted,
                "connects": d.connects,
                "moved": d.moved,
                "asked": d.asked,
                "slot_map_reads": d.slot_map_reads,
                "last_error": d.last_error,
            }
        )

    def text() -> str:
        if not on:
            return f'no fleet directory on {conn.socket} (set directory = "redis://..." in the peer tier)'
        shards = ", ".join(d.shards) or "(not connected)"
        lines = [
            f"directory {d.url}: breaker {data['breaker']}, {len(d.shards)} shard(s): {shards}",
            f"writes: {d.write_batches} batches, {d.write_commands} commands, {d.write_errors} failed; "
            f"lag {d.lag_s:.2f} s, {d.pending_changes} changes pending, {d.refreshed} chunks refreshed, "
            f"{d.dropped_changes} dropped",
            f"lookups: {d.lookups} ({d.lookup_chunks} chunks, {d.hit_chunks} hits), {d.errors} errors, "
            f"{d.timeouts} timeouts, {d.refused} refused by the breaker; {d.found_peers} holder(s) found",
            f"cluster: {d.connects} connections opened, {d.slot_map_reads} slot maps read, "
            f"{d.moved} MOVED and {d.asked} ASK followed",
        ]
        if d.last_error:
            lines.append(f"last error: {d.last_error}")
        return "\n".join(lines)

    emit(args, data, text)
    return 0


def event_dict(e: pb.KvEvent) -> dict[str, Any]:
    return {
        "seq": e.seq,
        "ts": e.ts,
        "type": pb.EventType.Name(e.type).removeprefix("EVENT_TYPE_").lower(),
        "cause": pb.EventCause.Name(e.cause).removeprefix("EVENT_CAUSE_").lower(),
        "tier": e.tier,
        "tier_kind": kind_name(e.tier_kind),
        "namespace_id": e.namespace_id,
        "keys": [k.hex() for k in e.keys],
    }


def event_line(d: dict[str, Any]) -> str:
    """One line per event, ids and keys in full: what `lookup -n NAMESPACE KEY...` takes."""
    stamp = time.strftime("%H:%M:%S", time.localtime(d["ts"])) + f".{int(d['ts'] * 1000) % 1000:03d}"
    return (
        f"{d['seq']:>8} {stamp} {d['type']:<8} {d['cause']:<12} {d['tier']:<6} "
        f"{d['namespace_id']:<32} {len(d['keys']):>4}  {' '.join(d['keys'])}"
    ).rstrip()


EVENTS_HEADER = f"{'SEQ':>8} {'TIME':<12} {'TYPE':<8} {'CAUSE':<12} {'TIER':<6} {'NAMESPACE':<32} {'KEYS':>4}"


def watch(
    conn: Conn, from_seq: int, incarnation: int = 0, on_call: Callable[[Any], None] = lambda call: None
) -> Iterator[tuple[int, pb.KvEvent]]:
    """Events from `from_seq` of the daemon run `incarnation` on (0: live only; incarnation 0:
    whichever run serves), each with the run it is of; resumes by itself, in the same run, if
    the daemon cuts us off for falling behind (events between are replayed while still
    buffered). Events no longer buffered are skipped with a warning: this is a viewer, not a
    router. `on_call` gets each stream call (so another thread can cancel it)."""
    while True:
        last = from_seq - 1
        try:
            call = conn.kv.WatchEvents(pb.WatchEventsRequest(from_seq=from_seq, incarnation=incarnation))
            on_call(call)
            served = _incarnation(call.initial_metadata())
            incarnation = incarnation or served
            for event in call:
                last = event.seq
                yield incarnation, event
            return  # the daemon is shutting down
        except grpc.RpcError as exc:
            oldest = _oldest_seq(exc)
            same_run = _incarnation(exc.initial_metadata()) in (0, incarnation)
            if exc.code() is grpc.StatusCode.OUT_OF_RANGE and oldest is not None and from_seq < oldest and same_run:
                print(f"{PROG}: events {from_seq}-{oldest - 1} are no longer buffered; from {oldest}", file=sys.stderr)
                from_seq = oldest
                continue
            if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or last < 0:
                raise conn.error("WatchEvents", exc) from None
            print(f"{PROG}: fell behind after event {last}; resuming", file=sys.stderr)
            from_seq = last + 1


def _incarnation(metadata: Any) -> int:
    for key, value in metadata or ():
        if key == INCARNATION_KEY:
            return int(value)
    return 0


def _oldest_seq(exc: grpc.RpcError) -> int | None:
    for key, value in exc.trailing_metadata() or ():
        if key == OLDEST_SEQ_KEY:
            return int(value)
    return None


class EventFeed:
    """`watch()` read on a thread, so that the caller can stop waiting once no event has come
    for a while (a gRPC stream has no read timeout). Use with `with`: leaving cancels the stream."""

    _END = object()

    def __init__(self, conn: Conn, from_seq: int, incarnation: int = 0) -> None:
        self._conn = conn
        self._from_seq = from_seq
        self._incarnation = incarnation
        self._queue: queue.Queue = queue.Queue()
        self._call: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self.ended = False  # the daemon ended the stream (it is stopping), as opposed to a quiet spell
        self._thread = threading.Thread(target=self._read, name="kvstoredctl-events", daemon=True)

    def __enter__(self) -> EventFeed:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._closed = True
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=self._conn.timeout)

    def events(self, idle_s: float | None) -> Iterator[tuple[int, pb.KvEvent]]:
        """(daemon run, event) until the stream ends or, with `idle_s`, until none arrived for that long."""
        while True:
            try:
                item = self._queue.get(timeout=idle_s)
            except queue.Empty:
                return
            if item is self._END:
                self.ended = True
                return
            if isinstance(item, CtlError):
                raise item
            yield item

    def _on_call(self, call: Any) -> None:
        with self._lock:
            self._call = call
            closed = self._closed
        if closed:
            call.cancel()

    def _read(self) -> None:
        try:
            for item in watch(self._conn, self._from_seq, self._incarnation, self._on_call):
                self._queue.put(item)
        except CtlError as exc:
            if not self._closed:  # a cancelled stream is how we stop it
                self._queue.put(exc)
        finally:
            self._queue.put(self._END)


def cmd_events(conn: Conn, args: argparse.Namespace) -> int:
    if args.wait is not None and args.wait < 0:
        raise UsageError(f"--wait must be >= 0 seconds, got {args.wait:g}")
    # --count alone stops once the buffer is replayed and nothing more comes (it waited forever)
    wait = args.wait if args.wait is not None else (DEFAULT_COUNT_WAIT_S if args.count else 0)
    shown = 0
    if not args.json:
        print(EVENTS_HEADER, flush=True)
    with EventFeed(conn, args.from_seq, args.incarnation) as feed:
        for incarnation, event in feed.events(wait or None):
            if args.namespace and event.namespace_id != args.namespace:
                continue
            d = event_dict(event) | {"incarnation": incarnation}
            print(json.dumps(d) if args.json else event_line(d), flush=True)
            shown += 1
            if args.count and shown >= args.count:
                return 0
        why = "the daemon ended the stream" if feed.ended else f"none came for {wait:g}s (--wait)"
    if args.count:
        print(f"{PROG}: {shown} of {args.count} events: {why}", file=sys.stderr)
    return 0


def cmd_top(conn: Conn, args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise UsageError(f"--interval must be > 0 seconds, got {args.interval:g}")
    source = top.StatsSource(str(conn.socket), lambda: conn.call("Stats", pb.StatsRequest()), CtlError)
    if args.once:
        # rates need two answers: the second comes --interval after the first
        first = source.sample()
        time.sleep(args.interval)
        frame = top.build_frame(str(conn.socket), source.sample(), first)
        width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None  # a pipe gets every column
        emit(args, top.frame_dict(frame), lambda: "\n".join(top.render(frame, width=width)))
        return 0
    if args.json:
        raise UsageError("--json needs --once (the live view is for a terminal)")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the live view needs a terminal; use --once (and --json) in scripts")
    top.run_live(source, args.interval)
    return 0


def cmd_namespace_id(args: argparse.Namespace) -> int:
    ns_id = namespace_id_for(
        args.model, args.dtype, args.chunk_bytes, args.layout, args.tenant_salt_hex, args.key_bytes
    )
    emit(args, {"namespace_id": ns_id}, lambda: ns_id)
    return 0


# -- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: the options work before and after the command without overwriting each other
    common.add_argument(
        "--socket",
        type=Path,
        default=argparse.SUPPRESS,
        help="the daemon's gRPC socket (default: $KVSTORED_SOCKET or the system socket)",
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    common.add_argument(
        "--timeout",
        type=seconds_arg,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help="per-request deadline (default 5)",
    )

    parser = argparse.ArgumentParser(
        prog=PROG,
        parents=[common],
        description="Inspect and operate a running kvstored.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable, help_text: str, aliases: Iterable[str] = ()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text, aliases=list(aliases))
        p.set_defaults(func=func)
        return p

    add("status", cmd_status, "health, sessions and leases, and one line per tier")
    add("stats", cmd_stats, "every counter of every tier")
    add("health", cmd_health, "the gRPC health status; exit 0 only when SERVING")

    def keyed(p: argparse.ArgumentParser) -> None:
        p.add_argument("-n", "--namespace", required=True, metavar="ID", help="namespace id (32 hex digits)")
        p.add_argument("keys", nargs="*", metavar="KEY", help="keys in hex")
        p.add_argument("--keys-file", metavar="FILE", help="more hex keys, one per line ('-': stdin)")

    keyed(
        add(
            "lookup",
            cmd_lookup,
            "which tier holds each key. A lookup is a use: it refreshes the key "
            "in RAM's LRU order and starts promoting keys found below RAM",
            aliases=["inspect"],
        )
    )
    keyed(add("evict", cmd_evict, "delete keys from every tier", aliases=["delete"]))
    clear = add("clear", cmd_clear, "remove every chunk of a namespace the daemon knows of, from every tier")
    clear.add_argument("-n", "--namespace", required=True, metavar="ID", help="namespace id (32 hex digits)")
    add(
        "namespaces",
        cmd_namespaces,
        "the namespaces the daemon knows (registered by clients, or recovered at start "
        "from its tiers' records: SOURCE recovered:TIERS), their RAM use and quota; tenant namespaces are hidden "
        "(tenants are shown in aggregate)",
    )

    events = add(
        "events",
        cmd_events,
        "tail KV events (stored/removed, per tier), one per line with the full "
        "namespace id and keys (what lookup and evict take), until interrupted, --count events, or "
        "--wait seconds without one",
    )
    events.add_argument(
        "--from-seq",
        type=uint64_arg,
        default=0,
        metavar="N",
        help="replay buffered events from seq N first (1: all still buffered; default: live only)",
    )
    events.add_argument(
        "--incarnation",
        type=uint64_arg,
        default=0,
        metavar="N",
        help="the daemon run --from-seq is of (each --json event's 'incarnation'): another run's is an error",
    )
    events.add_argument(
        "--count",
        type=uint64_arg,
        default=0,
        metavar="N",
        help=f"stop after N events, or when none came for --wait seconds "
        f"(default {DEFAULT_COUNT_WAIT_S:g}; fewer than N: a note on stderr, exit 0)",
    )
    events.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop when no event came for SECONDS (0: wait forever, the default without --count)",
    )
    events.add_argument("-n", "--namespace", metavar="ID", help="only this namespace's events")

    add(
        "peers",
        cmd_peers,
        "the peer tier: each peer's address, state, data transport, chunks indexed, bytes "
        "fetched from it (IN) and served to it (OUT), breaker, fetches, stale index entries (MISSING) and failed "
        "fetches; what this daemon serves and leases to peers",
    )
    add(
        "directory",
        cmd_directory,
        "the fleet directory (Redis Cluster): its shards, breaker, write lag and batches, lookups and hits",
    )

    view = add(
        "top",
        cmd_top,
        "a live view like top: per tier hit rate, utilization, bytes/s in and out, "
        "queue depth, drops, promotions and evictions, with sessions and leases; rates are "
        "differences between Stats answers --interval apart. q or Ctrl-C quits",
    )
    view.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between refreshes, and the span of the rates (default 1)",
    )
    view.add_argument(
        "--once",
        action="store_true",
        help="print one frame (rates over one --interval) and exit: for scripts, with --json",
    )

    nsid = add("namespace-id", cmd_namespace_id, "the id a namespace spec gets (computed here; no daemon needed)")
    nsid.add_argument("--model", required=True)
    nsid.add_argument("--dtype", required=True)
    nsid.add_argument(
        "--chunk-bytes",
        required=True,
        type=size_arg,
        metavar="SIZE",
        help="chunk size in bytes or with a unit, as the daemon takes it: 2097152, 2MiB",
    )
    nsid.add_argument("--layout", default="")
    nsid.add_argument("--key-bytes", type=int, default=32)
    nsid.add_argument("--tenant-salt-hex", type=bytes.fromhex, default=b"", metavar="HEX")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.json = getattr(args, "json", False)
    args.timeout = getattr(args, "timeout", 5.0)
    socket = getattr(args, "socket", None) or default_socket_path()
    try:
        if args.func is cmd_namespace_id:
            return cmd_namespace_id(args)
        conn = Conn(Path(socket), args.timeout)
        try:
            return args.func(conn, args)
        finally:
            conn.close()
    except UsageError as exc:
        parser.error(str(exc))
    except CtlError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `kvstoredctl events | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
