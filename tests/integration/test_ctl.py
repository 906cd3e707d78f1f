# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstoredctl against a real daemon: what it prints equals what the daemon says, it acts on
keys, and a daemon that is down gives one clear line and a non-zero exit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from kvstored_client.keys import namespace_id_for
from tests.support.daemon import clean_env
from tests.support.data import make_keys, payloads

MIB = 1 << 20
CTL = [sys.executable, "-m", "kvstored.ctl"]


def ctl(*args: str, socket_path: Path | str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    argv = CTL + (["--socket", str(socket_path)] if socket_path else []) + list(args)
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, env=clean_env())


def ok(*args: str, **kwargs) -> str:
    proc = ctl(*args, **kwargs)
    assert proc.returncode == 0, f"kvstoredctl {' '.join(args)} -> {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def stored(daemon, label: str, n: int):
    """A client with `n` chunks stored under a fresh namespace (the client stays open)."""
    kv = daemon.client()
    ns = kv.register_namespace(model=f"ctl-{label}", dtype="uint8", chunk_bytes=MIB)
    keys = make_keys(label, n)
    assert kv.store(ns, keys, payloads(keys, MIB)).stored == n
    return kv, ns, keys


def test_status_stats_and_health_report_what_stats_says(daemon):
    kv, ns, keys = stored(daemon, "status", 4)
    with kv:
        kv.lookup(ns, keys)  # RAM hits, answered from the key index: counted once the client tells
        kv.stats()  # the daemon (its next call does, a gRPC call at once)
        data = json.loads(ok("status", "--json", socket_path=daemon.socket))
        stats = daemon.stats()
        assert data["health"] == "SERVING" and data["version"] == stats.version
        assert (data["sessions"], data["leases"], data["namespaces"]) == (1, 0, 1)
        assert data["staging"] == {"capacity_bytes": 0, "used_bytes": 0, "staged_chunks": 0}  # no tier below RAM
        assert [t["name"] for t in data["tiers"]] == [t.name for t in stats.tiers] == ["ram"]
        ram, ram_stats = data["tiers"][0], stats.tiers[0]
        for field in ("capacity_bytes", "used_bytes", "chunks", "lookups", "hits", "evictions", "stored_chunks"):
            assert ram[field] == getattr(ram_stats, field), field
        assert ram["kind"] == "ram" and ram["chunks"] == 4 and ram["hit_ratio"] == 1.0
        assert ram["utilization"] == ram_stats.used_bytes / ram_stats.capacity_bytes

        text = ok("status", socket_path=daemon.socket)
        assert f"on {daemon.socket}: SERVING" in text and "staging off" in text
        header = next(line for line in text.splitlines() if line.startswith("TIER"))
        assert header.split()[:4] == ["TIER", "KIND", "USED", "CAPACITY"]
        ram_line = next(line for line in text.splitlines() if line.startswith("ram "))
        assert ram_line.split()[:3] == ["ram", "ram", "4.0"] and "100.0%" in ram_line  # used 4.0 MiB, all hits

        table = ok("stats", socket_path=daemon.socket)
        rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
        for field in ("lookups", "hits", "chunks", "evictions", "dropped_dirty", "checksum_failures", "queued"):
            assert rows[field][0] == str(getattr(daemon.stats().tiers[0], field)), field
        # the word metrics and docs use (kvstored_tier_writedowns_total): never "writebacks"
        assert "writedowns" in rows and "writeback" not in table

    assert ok("health", socket_path=daemon.socket).startswith("SERVING")
    assert json.loads(ok("--json", "health", socket_path=daemon.socket))["status"] == "SERVING"


def test_lookup_and_evict_hex_keys(shared_daemon):
    daemon = shared_daemon
    kv, ns, keys = stored(daemon, "keys", 3)
    missing = make_keys("keys-missing", 1)[0]
    with kv:
        text = ok("lookup", "-n", ns.namespace_id, *(k.hex() for k in keys + [missing]), socket_path=daemon.socket)
        rows = dict(line.split() for line in text.splitlines()[1:5])
        assert rows == {**{k.hex(): "ram" for k in keys}, missing.hex(): "miss"}
        assert "3 of 4 cached, 3 leading" in text

        stdin = "\n".join(k.hex() for k in [keys[0], missing, keys[2]]) + "\n"
        data = json.loads(
            ok("inspect", "--json", "-n", ns.namespace_id, "--keys-file", "-", socket_path=daemon.socket, stdin=stdin)
        )
        assert [k["tier"] for k in data["keys"]] == ["ram", None, "ram"]
        assert (data["prefix_hits"], data["hits"]) == (1, 2)

        out = json.loads(
            ok(
                "evict",
                "--json",
                "-n",
                ns.namespace_id,
                keys[0].hex(),
                keys[1].hex(),
                missing.hex(),
                socket_path=daemon.socket,
            )
        )
        assert (out["requested"], out["deleted"]) == (3, 2)
        assert kv.lookup(ns, keys).tiers[:2] == [0, 0] and kv.lookup(ns, keys[2:]).prefix_hits == 1
        assert "deleted 0 of 1 keys" in ok("delete", "-n", ns.namespace_id, keys[0].hex(), socket_path=daemon.socket)


def test_events_replays_and_tails(daemon):
    kv, ns, keys = stored(daemon, "events", 2)
    with kv:
        kv.delete(ns, keys[:1])
        lines = ok("events", "--json", "--from-seq", "1", "--count", "2", socket_path=daemon.socket).splitlines()
        events = [json.loads(line) for line in lines]
        assert [(e["seq"], e["type"], e["cause"], e["tier"]) for e in events] == [
            (1, "stored", "stored", "ram"),
            (2, "removed", "deleted", "ram"),
        ]
        assert events[0]["keys"] == [k.hex() for k in keys] and events[1]["keys"] == [keys[0].hex()]
        assert all(e["namespace_id"] == ns.namespace_id for e in events)

        text = ok("events", "--from-seq", "1", "--count", "1", "-n", ns.namespace_id, socket_path=daemon.socket)
        header, line = text.splitlines()
        assert header.split() == ["SEQ", "TIME", "TYPE", "CAUSE", "TIER", "NAMESPACE", "KEYS"]
        fields = line.split()
        assert fields[0] == "1" and fields[2:5] == ["stored", "stored", "ram"]
        # the namespace id and the keys in full: what lookup takes
        assert fields[5] == ns.namespace_id and fields[6] == "2" and fields[7:] == [k.hex() for k in keys]
        looked = ok("lookup", "-n", fields[5], *fields[7:], socket_path=daemon.socket)
        assert "1 of 2 cached, 0 leading" in looked  # keys[0] was deleted above


def test_events_count_stops_when_fewer_are_buffered(daemon):
    kv, ns, keys = stored(daemon, "events-few", 1)
    with kv:
        proc = ctl("events", "--json", "--from-seq", "1", "--count", "5", "--wait", "0.5", socket_path=daemon.socket)
        assert proc.returncode == 0, proc.stderr
        assert [json.loads(line)["seq"] for line in proc.stdout.splitlines()] == [1]
        assert "1 of 5 events: none came for 0.5s (--wait)" in proc.stderr
        # without --count, --wait ends the tail too (no note: no number was asked for)
        proc = ctl("events", "--from-seq", "1", "--wait", "0.5", socket_path=daemon.socket)
        assert proc.returncode == 0 and proc.stderr == "" and len(proc.stdout.splitlines()) == 2
        proc = ctl("events", "--wait", "-1", socket_path=daemon.socket)
        assert proc.returncode == 2 and "--wait must be >= 0" in proc.stderr


def test_events_from_a_seq_no_longer_buffered_start_at_the_oldest_with_a_warning(daemon_factory):
    daemon = daemon_factory(extra_args=["--events-buffer", "4"], cpu_bytes="64MiB")
    kv, ns, keys = stored(daemon, "events-gone", 1)
    with kv:
        for _ in range(3):  # 7 events in all: seqs 1-3 are gone from a 4-event buffer
            kv.delete(ns, keys)
            assert kv.store(ns, keys, payloads(keys, MIB)).stored == 1
        proc = ctl("events", "--json", "--from-seq", "1", "--count", "2", socket_path=daemon.socket)
        assert proc.returncode == 0, proc.stderr
        assert [json.loads(line)["seq"] for line in proc.stdout.splitlines()] == [4, 5]
        assert "events 1-3 are no longer buffered" in proc.stderr
        # A seq past the newest (an earlier daemon's) is an error, not a replay from the oldest.
        proc = ctl("events", "--json", "--from-seq", "100", "--count", "1", socket_path=daemon.socket)
        assert proc.returncode == 1 and proc.stdout == ""
        assert "OUT_OF_RANGE: events from seq 100 are ahead of this daemon's newest (seq 7)" in proc.stderr


def test_daemon_down_is_one_line_naming_the_socket(tmp_path):
    missing = tmp_path / "none.sock"
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # the file stays, nobody listens: a killed daemon's socket
    for path, why in ((missing, "no such socket"), (stale, "nothing is serving on it")):
        for command in (["status"], ["health"], ["stats", "--json"], ["lookup", "-n", "0" * 32, "00" * 32]):
            proc = ctl(*command, socket_path=path)
            assert proc.returncode == 1, (command, proc)
            assert proc.stdout == ""
            assert proc.stderr.count("\n") == 1, proc.stderr
            assert proc.stderr.startswith(f"kvstoredctl: cannot reach kvstored at {path}: {why}"), proc.stderr


def test_bad_input_and_daemon_refusals(shared_daemon):
    daemon = shared_daemon
    proc = ctl("lookup", "-n", "0" * 32, "xyz", socket_path=daemon.socket)
    assert proc.returncode == 2 and "not a hex key: 'xyz'" in proc.stderr
    proc = ctl("evict", "-n", "0" * 32, socket_path=daemon.socket)
    assert proc.returncode == 2 and "no keys" in proc.stderr
    proc = ctl("lookup", "-n", "0" * 32, "00" * 32, socket_path=daemon.socket)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"kvstoredctl: Lookup failed on {daemon.socket}: NOT_FOUND: unknown namespace")


def test_out_of_range_arguments_are_usage_errors_not_tracebacks(tmp_path):
    """Each is exit 2 with one line naming the argument, before any daemon is asked."""
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)))
    cases = [
        (["events", "--from-seq", "-1"], "argument --from-seq: must be 0 to 2**64 - 1, got -1"),
        (["events", "--from-seq", str(1 << 64)], "argument --from-seq: must be 0 to 2**64 - 1"),
        (["events", "--count", "-1"], "argument --count: must be 0 to 2**64 - 1, got -1"),
        (["--timeout", "nan", "status"], "argument --timeout: must be a finite number of seconds > 0, got 'nan'"),
        (["--timeout", "-1", "status"], "argument --timeout: must be a finite number of seconds > 0, got '-1'"),
        (["lookup", "-n", "0" * 32, "--keys-file", str(tmp_path / "missing")], "No such file or directory"),
        (["lookup", "-n", "0" * 32, "--keys-file", str(binary)], "is not text (hex keys, one per line)"),
        (["lookup", "-n", "0" * 32, "--keys-file", "/dev/zero"], "has a line longer than 1024 characters"),
    ]
    for args, said in cases:
        proc = ctl(*args, socket_path=tmp_path / "absent.sock")
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr


def test_namespace_id_is_the_daemons_id(shared_daemon):
    kv, ns, _ = stored(shared_daemon, "nsid", 1)
    kv.close()
    got = ok("namespace-id", "--model", "ctl-nsid", "--dtype", "uint8", "--chunk-bytes", str(MIB)).strip()
    assert got == ns.namespace_id
    # sizes as the daemon takes them
    assert ok("namespace-id", "--model", "ctl-nsid", "--dtype", "uint8", "--chunk-bytes", "1MiB").strip() == got
    proc = ctl("namespace-id", "--model", "m", "--dtype", "d", "--chunk-bytes", "2 parsecs")
    assert proc.returncode == 2 and "not a byte size: '2 parsecs'" in proc.stderr
    salted = json.loads(
        ok(
            "--json",
            "namespace-id",
            "--model",
            "m",
            "--dtype",
            "bf16",
            "--chunk-bytes",
            "4096",
            "--layout",
            "tp2",
            "--key-bytes",
            "16",
            "--tenant-salt-hex",
            "abcd",
        )
    )
    assert salted["namespace_id"] == namespace_id_for("m", "bf16", 4096, "tp2", b"\xab\xcd", 16)


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "kvstoredctl"
    assert script.exists(), f"{script} missing: run `make setup` (pyproject.toml declares the kvstoredctl script)"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "status" in proc.stdout and "events" in proc.stdout


def test_namespaces_and_clear_a_namespace_from_every_tier(daemon_factory, tmp_path):
    from tests.support.daemon import short_tmpdir

    root = short_tmpdir("kvfs")
    d = daemon_factory(["--tiers", f"kind=fs,root={root},bytes=64MiB"], cpu_bytes="1MiB")
    chunk = 64 << 10
    with d.client() as kv:
        keep = kv.register_namespace(model="keep", dtype="u8", chunk_bytes=chunk)
        gone = kv.register_namespace(model="gone", dtype="u8", chunk_bytes=chunk)
        keep_keys, gone_keys = make_keys("keep", 8), make_keys("gone", 24)  # 24 > RAM: some land on fs
        kv.store(keep, keep_keys, payloads(keep_keys, chunk))
        for i in range(0, 24, 8):
            kv.store(gone, gone_keys[i : i + 8], payloads(gone_keys[i : i + 8], chunk))

        listed = json.loads(ok("namespaces", "--json", socket_path=d.socket))
        assert {n["model"] for n in listed} == {"keep", "gone"}
        assert {n["namespace_id"] for n in listed} == {keep.namespace_id, gone.namespace_id}

        out = json.loads(ok("clear", "-n", gone.namespace_id, "--json", socket_path=d.socket))
        assert out["removed"] >= 24  # every RAM copy plus the files written down
        assert kv.lookup(gone, gone_keys).prefix_hits == 0
        assert not any(root.rglob(f"{gone.namespace_id}/**/*.kv"))
        assert kv.lookup(keep, keep_keys[-4:]).prefix_hits == 4  # the other namespace is untouched
