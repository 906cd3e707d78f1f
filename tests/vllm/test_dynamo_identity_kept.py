# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Block identities beyond the client's store, seen by Dynamo 1.6.1's own standalone indexer:

- a chunk node B fetched from peer A and keeps is in the index under B at the CPU tier (the
  identity A had, carried by A's fetch reply), and leaves it when B drops it;
- a restarted daemon publishes what its fs tier still holds (the identity kept in each chunk
  file's header); a corrupt or truncated identity record leaves its chunk unpublished and still
  loading byte-exact.
"""

from __future__ import annotations

import re
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np

from kvstored.chunks import chunkfile
from kvstored_client import chunk_identities
from tests.support.cluster import Cluster
from tests.support.daemon import Daemon, short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.ports import free_port
from tests.support.wait import wait_for
from tests.vllm.dynamo import DynamoIndexer

MODEL = "org/identity-model"
BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = 4  # 64 tokens per chunk
CHUNK = 256 << 10
FOOTER = struct.Struct("<4sHHII")  # tiers/fs/identity_area.py's, at the header's end


def _prompt(label: str, chunks: int) -> tuple[list[bytes], list[int], list]:
    """Keys, token ids and the chunks' identities of a made-up prompt (Dynamo keys its tree by
    the tokens; the hashes are the engine's ids for parents and removals)."""
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    blocks = chunks * BLOCKS_PER_CHUNK
    tokens = [int(t) for t in rng.integers(100, 30_000, blocks * BLOCK_SIZE)]
    hashes = [int(h) for h in rng.integers(1, 1 << 63, blocks, dtype=np.int64)]
    return make_keys(label, chunks), tokens, chunk_identities(hashes, tokens, BLOCK_SIZE, BLOCKS_PER_CHUNK)


def _fields() -> dict:
    return {"model": MODEL, "dtype": "u8", "chunk_bytes": CHUNK}


def test_a_chunk_fetched_from_a_peer_is_indexed_under_the_node_that_keeps_it(tmp_path):
    root = short_tmpdir("kvid")
    keys, tokens, identities = _prompt("fetched", 2)
    depth = len(tokens)
    with Cluster(2, "tcp", cpu_bytes="16MiB") as cluster:
        a, b = cluster
        for d, name in ((a, "a"), (b, "b")):  # A publishes too: only then does it keep identities
            d.args += ["--events-zmq-endpoint", f"ipc://{root}/{name}.sock", "--events-node", name]
        cluster.start()
        cluster.wait_up(1)
        indexer = DynamoIndexer(f"ipc://{root}/b.sock", MODEL, BLOCK_SIZE, tmp_path / "dynamo-b.log")
        try:
            with a.client() as kv:
                ns = kv.register_namespace(**_fields())
                assert kv.store(ns, keys, payloads(keys, CHUNK), blocks=identities).stored == len(keys)
            cluster.wait_indexed(1, 0, len(keys))
            assert indexer.overlap(tokens).get("longest_matched", 0) == 0  # B holds nothing yet

            with b.client() as kv:
                ns = kv.register_namespace(**_fields())
                out = np.empty((len(keys), CHUNK), np.uint8)
                assert kv.load(ns, keys, out) == len(keys)  # fetched from A, kept in B's RAM
                assert np.array_equal(out, payloads(keys, CHUNK))
                assert wait_for(lambda: indexer.overlap(tokens).get("cpu") == depth)
                assert indexer.overlap(tokens)["longest_matched"] == depth
                assert b.peer(a).received_chunks >= len(keys)

                assert kv.delete(ns, keys) == len(keys)  # gone from B (A keeps its own)
            assert wait_for(lambda: indexer.overlap(tokens).get("longest_matched", 0) == 0)
            log = (tmp_path / "dynamo-b.log").read_text()
            assert "ownership" not in log and "too short" not in log and "Block size" not in log
        finally:
            indexer.stop()
            shutil.rmtree(root, ignore_errors=True)


def _chunk_file(fs_root: Path, namespace_id: str, key: bytes) -> Path:
    return fs_root / chunkfile.chunk_relpath((namespace_id, key))


def _corrupt_record(path: Path) -> None:
    """Flip a byte of the identity record: its crc no longer matches."""
    with open(path, "r+b") as fh:
        fh.seek(chunkfile.HEADER_BYTES - FOOTER.size - 1)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _truncate_record(path: Path) -> None:
    """Cut the record's last 8 bytes, with a footer that frames (and checksums) what is left: only
    the record's own length check can tell."""
    with open(path, "r+b") as fh:
        fh.seek(chunkfile.HEADER_BYTES - FOOTER.size)
        magic, version, reserved, length, _ = FOOTER.unpack(fh.read(FOOTER.size))
        fh.seek(chunkfile.HEADER_BYTES - FOOTER.size - length)
        record = fh.read(length)
        cut = record[:-8]
        fh.seek(chunkfile.HEADER_BYTES - FOOTER.size - len(cut))
        fh.write(cut)
        fh.write(FOOTER.pack(magic, version, reserved, len(cut), zlib.crc32(cut)))


def test_a_restarted_daemon_publishes_what_its_disk_holds_and_never_a_doubtful_identity(tmp_path):
    root = short_tmpdir("kvid")
    fs_root = Path(root) / "fs"
    endpoint = f"ipc://{root}/events.sock"
    args = [
        "--events-zmq-endpoint",
        endpoint,
        "--events-zmq-replay-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--tiers",
        f"kind=fs,root={fs_root},bytes=64MiB",
        "--write-policy",
        "write-through",
    ]
    keys, tokens, identities = _prompt("restarted", 3)
    per_chunk = BLOCKS_PER_CHUNK * BLOCK_SIZE
    daemon = Daemon(cpu_bytes="16MiB")
    indexer = None
    try:
        daemon.start(args)
        with daemon.client() as kv:
            ns = kv.register_namespace(**_fields())
            assert kv.store(ns, keys, payloads(keys, CHUNK), blocks=identities).stored == len(keys)
            assert wait_for(lambda: all(_chunk_file(fs_root, ns.namespace_id, k).exists() for k in keys))
        daemon.stop()  # (SIGTERM: the write-throughs land first)
        _corrupt_record(_chunk_file(fs_root, ns.namespace_id, keys[1]))
        _truncate_record(_chunk_file(fs_root, ns.namespace_id, keys[2]))

        daemon.start(args)
        indexer = DynamoIndexer(endpoint, MODEL, BLOCK_SIZE, tmp_path / "dynamo.log")
        assert wait_for(lambda: "chunks read back" in daemon.log)
        line = next(x for x in daemon.log.splitlines() if "chunks read back" in x)
        assert re.search(r"1 published, 0 without an identity, 2 with a doubtful one", line), line
        # the first chunk, on disk: the chain stops where the doubtful records are
        assert wait_for(lambda: indexer.overlap(tokens).get("disk") == per_chunk)
        assert indexer.overlap(tokens).get("cpu", 0) == 0  # not in RAM (a restart)
        assert indexer.overlap(tokens)["longest_matched"] == per_chunk

        with daemon.client() as kv:
            ns = kv.register_namespace(**_fields())
            out = np.empty((len(keys), CHUNK), np.uint8)
            assert kv.load(ns, keys, out) == len(keys)  # every chunk loads, doubtful identity or not
            assert np.array_equal(out, payloads(keys, CHUNK))
        # promoted into RAM: the first chunk at the CPU tier too, the others still unpublished
        assert wait_for(lambda: indexer.overlap(tokens).get("cpu") == per_chunk)
        assert indexer.overlap(tokens)["longest_matched"] == per_chunk
        log = (tmp_path / "dynamo.log").read_text()
        assert "ownership" not in log and "too short" not in log and "Block size" not in log
    finally:
        if indexer is not None:
            indexer.stop()
        if daemon.running:
            daemon.stop()
        daemon.cleanup()
        shutil.rmtree(root, ignore_errors=True)
