# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A client process for multi-process tests: `python -m tests.support.worker COMMAND ...`.

Commands (each prints one JSON line on stdout):
  store   store n chunks (keys from --label), print the StoreResult
  verify  load n chunks and compare them with their expected bytes
  hold    store n chunks, lease them all through this client's session (and reserve
          --reserve more keys without committing; with --scribble, fill those slots with
          0xEE), print the lease handles, then block until killed or stdin closes
  mix     until stdin closes: store batches of new keys, look up and load random earlier ones
          (every loaded byte compared with its key's payload), now and then delete one; print
          the totals (the daemon may be killed meanwhile: misses and drops are fine, wrong
          bytes are not)
With --wait, store/verify block on stdin after printing, keeping their session open.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading

import numpy as np

from kvstored_client import Client
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from kvstored_client.errors import Unavailable
from tests.support.data import make_keys, payloads


def _set_at_eof(event: threading.Event) -> None:
    """Set `event` once stdin closes (the parent test ended or let go of us)."""
    sys.stdin.read()
    event.set()


def spawn(command: str, socket, model: str, chunk: int, label: str, n: int, *extra: str) -> subprocess.Popen:
    """Start a worker process (stdin/stdout piped; close stdin to let a --wait/hold worker exit)."""
    from tests.support.daemon import REPO_ROOT, clean_env

    argv = [
        sys.executable,
        "-m",
        "tests.support.worker",
        command,
        "--socket",
        str(socket),
        "--model",
        model,
        "--chunk",
        str(chunk),
        "--label",
        label,
        "--n",
        str(n),
        *extra,
    ]
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=clean_env(),
    )


def read_result(proc, timeout: float = 60.0) -> dict:
    """The JSON line a worker prints (raises with its stderr if it dies first)."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"worker printed nothing (exit {proc.returncode}):\n{err}")
    return json.loads(line)


def finish(proc, timeout: float = 60.0) -> None:
    """Close stdin and wait; the worker must exit 0."""
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker exited with {proc.returncode}:\n{err}")


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["store", "verify", "hold", "mix"])
    p.add_argument("--socket", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--chunk", type=int, required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reserve", type=int, default=0)
    p.add_argument("--wait", action="store_true")
    p.add_argument("--deadline", type=float, default=20.0, help="the client's deadline_s")
    p.add_argument("--scribble", action="store_true")
    p.add_argument("--no-store-ahead", action="store_true", help="hold no slots reserved ahead")
    args = p.parse_args(argv)

    client = Client(
        args.socket,
        deadline_s=args.deadline,
        client_name=f"worker-{args.command}-{args.label}",
        store_ahead=not args.no_store_ahead,
    )
    ns = client.register_namespace(model=args.model, dtype="uint8", chunk_bytes=args.chunk)
    if args.command == "mix":
        _emit(_mix(client, ns, args))
        client.close()
        return 0
    keys = make_keys(args.label, args.n, args.start)

    if args.command == "store":
        totals = {"stored": 0, "already_present": 0, "dropped": 0}
        for i in range(0, len(keys), args.batch):
            batch = keys[i : i + args.batch]
            res = client.store(ns, batch, payloads(batch, args.chunk))
            for k in totals:
                totals[k] += getattr(res, k)
        _emit(totals)
    elif args.command == "verify":
        out = np.zeros((len(keys), args.chunk), dtype=np.uint8)
        loaded = 0
        for i in range(0, len(keys), args.batch):
            loaded += client.load(ns, keys[i : i + args.batch], out[i : i + args.batch])
        expected = payloads(keys, args.chunk)
        bad = [i for i in range(len(keys)) if not np.array_equal(out[i], expected[i])]
        _emit({"loaded": loaded, "mismatched": bad})
    else:  # hold
        res = client.store(ns, keys, payloads(keys, args.chunk))
        session = client._session  # the client's own session: its leases die with this process
        assert session is not None and session.pool is not None
        stub = pb_grpc.KVStoreStub(client._channel)
        leases = stub.Acquire(pb.AcquireRequest(session_id=session.session_id, namespace_id=ns.namespace_id, keys=keys))
        reserved = []
        if args.reserve:
            rkeys = make_keys(args.label + "/reserved", args.reserve)
            slots = stub.Reserve(
                pb.ReserveRequest(session_id=session.session_id, namespace_id=ns.namespace_id, keys=rkeys)
            )
            reserved = [s.handle for s in slots.slots if s.state == pb.SLOT_STATE_RESERVED]
            if args.scribble:  # half-written chunks that are never committed
                for slot in slots.slots:
                    for extent in slot.extents:
                        session.pool[extent.offset : extent.offset + extent.length] = 0xEE
        _emit(
            {
                "stored": res.stored,
                "leases": [lease.handle for lease in leases.leases],
                "reserved": reserved,
                "session_id": session.session_id,
            }
        )
        sys.stdin.read()  # block until killed (or stdin closes)
        return 0

    if args.wait:
        sys.stdin.read()
    client.close()
    return 0


def _mix(client, ns, args) -> dict:
    stop = threading.Event()
    threading.Thread(target=_set_at_eof, args=(stop,), daemon=True).start()
    rng = random.Random(args.label)
    stored: list[bytes] = []
    totals = {
        "rounds": 0,
        "stored": 0,
        "dropped": 0,
        "loaded": 0,
        "loaded_bytes": 0,
        "mismatched": 0,
        "lookups": 0,
        "deleted": 0,
        "delete_unavailable": 0,
    }
    out = np.empty((args.batch, args.chunk), dtype=np.uint8)
    while not stop.is_set():
        keys = make_keys(f"{args.label}/{totals['rounds']}", args.batch)
        res = client.store(ns, keys, payloads(keys, args.chunk))
        totals["stored"] += res.stored + res.already_present
        totals["dropped"] += res.dropped
        if res.dropped == 0:
            stored += keys
        sample = rng.sample(stored, min(args.batch, len(stored)))
        if sample:
            totals["lookups"] += client.lookup(ns, sample).prefix_hits
            out[:] = 0
            n = client.load(ns, sample, out[: len(sample)])
            expected = payloads(sample[:n], args.chunk)
            totals["mismatched"] += sum(not np.array_equal(out[i], expected[i]) for i in range(n))
            totals["loaded"] += n
            totals["loaded_bytes"] += n * args.chunk
        if totals["rounds"] % 8 == 7 and stored:
            victim = stored.pop(rng.randrange(len(stored)))
            try:
                totals["deleted"] += client.delete(ns, [victim])
            except Unavailable:  # deletes raise when the daemon is gone (a miss would lie)
                totals["delete_unavailable"] += 1
        totals["rounds"] += 1
    return totals


if __name__ == "__main__":
    sys.exit(main())
