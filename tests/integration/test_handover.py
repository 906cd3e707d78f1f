# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""A restart keeps RAM: a new daemon started on the same socket takes the RAM tier over from the
running one (kvstored/server/handover.py), or from systemd's fd store; interrupted at any step,
or handed something doubtful, it starts cold and serves no wrong byte.

Each "old" and "new" daemon is a real process; a step is interrupted by the test hook
KVSTORED_TEST_HANDOVER_PAUSE, which stops the process (SIGSTOP) there: the test sees the stopped
state in /proc, then kills it or lets it go on (SIGCONT)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvstored_client import Tier
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.support.daemon import Daemon, short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.wait import wait_for

CHUNK = 64 << 10
SALT = b"handover-tenant"
PAUSE = "KVSTORED_TEST_HANDOVER_PAUSE"


@pytest.fixture
def workdir():
    path = short_tmpdir("kvho")
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture
def daemons():
    made: list[Daemon] = []
    yield made
    for d in made:
        if d.running:
            d.kill()


def make(daemons: list[Daemon], workdir: Path, cpu_bytes: str = "16MiB") -> Daemon:
    logs = workdir / f"daemon{len(daemons)}"  # (its own log: a second one in workdir would overwrite the first's)
    logs.mkdir()
    d = Daemon(workdir / "kv.sock", workdir=logs, cpu_bytes=cpu_bytes)
    daemons.append(d)
    return d


def fs_args(workdir: Path) -> list[str]:
    return ["--tiers", f"kind=fs,root={workdir / 'fs'},bytes=64MiB"]


def stopped(d: Daemon) -> bool:
    """The process is stopped (state T): it reached the step it was told to pause at."""
    stat = Path(f"/proc/{d.pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


def fill(d: Daemon, model: str, n: int = 48, tenant_n: int = 16) -> dict:
    """Public and tenant chunks; returns what to ask for afterwards."""
    keys, tkeys = make_keys("public", n), make_keys("tenant", tenant_n)
    with d.client() as kv:
        ns = kv.register_namespace(model=model, dtype="u8", chunk_bytes=CHUNK)
        tns = kv.register_namespace(model=model, dtype="u8", chunk_bytes=CHUNK, tenant_salt=SALT)
        for i in range(0, n, 8):
            assert kv.store(ns, keys[i : i + 8], payloads(keys[i : i + 8], CHUNK)).stored == 8
        assert kv.store(tns, tkeys, payloads(tkeys, CHUNK)).stored == tenant_n
    return {"model": model, "keys": keys, "tkeys": tkeys}


def where(d: Daemon, data: dict) -> tuple[list[Tier], list[Tier]]:
    """Each chunk's tier (public, tenant), checking that whatever loads is byte-exact."""
    out = []
    with d.client() as kv:
        for salt, keys in ((b"", data["keys"]), (SALT, data["tkeys"])):
            ns = kv.register_namespace(model=data["model"], dtype="u8", chunk_bytes=CHUNK, tenant_salt=salt)
            tiers = kv.lookup(ns, keys).tiers
            for key, tier in zip(keys, tiers, strict=True):
                got = np.zeros((1, CHUNK), dtype=np.uint8)
                loaded = kv.load(ns, [key], got)
                assert loaded == (tier is not Tier.NONE)
                if loaded:
                    assert np.array_equal(got, payloads([key], CHUNK)), "a wrong byte was served"
            out.append(tiers)
    return out[0], out[1]


def hand_over(old: Daemon, new: Daemon, new_args=(), new_env=None) -> None:
    """Start `new` beside `old`: `old` hands over and exits cleanly, then `new` serves."""
    new.spawn(new_args, new_env)
    assert old.wait() == 0, old.log
    new.wait_ready()


def test_restart_keeps_every_ram_chunk_a_byte_exact_ram_hit(daemons, workdir, ns_name):
    old = make(daemons, workdir).start()
    data = fill(old, ns_name)
    new = make(daemons, workdir)
    hand_over(old, new)
    public, tenant = where(new, data)
    assert public == [Tier.RAM] * len(data["keys"])
    assert tenant == [Tier.RAM] * len(data["tkeys"])
    assert f"RAM tier adopted: {len(data['keys']) + len(data['tkeys'])} chunks" in new.log
    # The adopted pool is not populated again (its pages exist); its free pages still take new chunks.
    assert "populating the RAM tier" not in new.log
    more = make_keys("after-adoption", 32)
    with new.client() as kv:
        ns = kv.register_namespace(model=data["model"], dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, more, payloads(more, CHUNK)).stored == len(more)
        got = np.zeros((len(more), CHUNK), dtype=np.uint8)
        assert kv.load(ns, more, got) == len(more) and np.array_equal(got, payloads(more, CHUNK))
    # ... and the next restart does it again (the adopted tier is handed over as it was).
    newer = make(daemons, workdir)
    hand_over(new, newer)
    assert where(newer, data) == ([Tier.RAM] * len(data["keys"]), [Tier.RAM] * len(data["tkeys"]))
    newer.stop()


def test_a_client_of_the_old_daemon_writes_nothing_into_the_new_ones_chunks(daemons, workdir, ns_name):
    """A client keeps its slots reserved ahead (RAM-only daemon) across a hand-over: the new
    daemon adopted the same pool with those pages free and gave them to another client's chunks.
    The old client's next store must not copy into them: it finds its session ended first."""
    old = make(daemons, workdir).start()
    before, theirs, mine = make_keys("before", 8), make_keys("theirs", 16), make_keys("mine", 4)
    with old.client() as a:
        ns = a.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert a.store(ns, before, payloads(before, CHUNK)).stored == 8
        assert a.stats().ahead_slots > 0  # (the slots its next stores copy into with no round trip)
        new = make(daemons, workdir)
        hand_over(old, new)
        with new.client() as b:
            ns_b = b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            assert b.store(ns_b, theirs, payloads(theirs, CHUNK)).stored == 16
            a.store(ns, mine, np.full((4, CHUNK), 0xAB, np.uint8))  # (whatever it reports)
            got = np.zeros((16, CHUNK), np.uint8)
            assert b.load(ns_b, theirs, got) == 16
            assert np.array_equal(got, payloads(theirs, CHUNK)), "the old client wrote into another chunk"
            got = np.zeros((8, CHUNK), np.uint8)
            assert b.load(ns_b, before, got) == 8 and np.array_equal(got, payloads(before, CHUNK))
            # What the old client stored once it had a new session is exact too.
            got = np.zeros((4, CHUNK), np.uint8)
            n = b.load(ns_b, mine, got)
            assert (got[:n] == 0xAB).all()
    new.stop()


def test_a_copy_under_way_at_the_hand_over_lands_in_no_other_chunk(daemons, workdir, ns_name):
    """A copy into a slot that passed its session check just before the old daemon ended the
    session still lands, whenever its thread runs again. The new daemon holds those pages until
    the client says it is done with that session: another client filling the whole pool meanwhile
    gets none of them, so the late copy (played here by writing the slot's pages through the old
    client's mapping) changes none of its chunks."""
    old = make(daemons, workdir).start()
    before, theirs = make_keys("before", 8), make_keys("theirs", 320)  # (256 chunks fill the 16 MiB pool)
    with old.client() as a:
        ns = a.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert a.store(ns, before, payloads(before, CHUNK)).stored == 8
        slots = list(a._session.ahead._slots[ns.namespace_id])
        assert slots, "the old client holds slots reserved ahead"
        old_session = a._session.session_id
        new = make(daemons, workdir)
        hand_over(old, new, METRICS)
        assert f"holding {len(slots)} slot(s) and 0 leased chunk(s) of ended session {old_session[:8]}" in new.log
        assert scrape(new).value("kvstored_ram_held_bytes") == len(slots) * CHUNK
        with new.client() as b:
            ns_b = b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            for i in range(0, len(theirs), 32):
                b.store(ns_b, theirs[i : i + 32], payloads(theirs[i : i + 32], CHUNK))
            pool = a._session.pool
            for slot in slots:  # the late copy
                for ext in slot.extents:
                    pool[ext.offset : ext.offset + ext.length] = 0xAB
            tiers = b.lookup(ns_b, theirs).tiers
            held = [k for k, t in zip(theirs, tiers, strict=True) if t is Tier.RAM]
            assert len(held) > 200  # (most of the pool holds their chunks)
            got = np.zeros((len(held), CHUNK), np.uint8)
            assert b.load(ns_b, held, got) == len(held)
            assert np.array_equal(got, payloads(held, CHUNK)), "a late copy landed in another chunk"
            # The old client's next call finds its session ended, waits for its own copies, and
            # names the old session in its new one's Hello: the held pages are free again.
            after = make_keys("after", 2)
            a.store(ns, after, payloads(after, CHUNK))
            assert wait_for(lambda: f"held pages of ended session {old_session[:8]}: its client is done" in new.log)
            assert scrape(new).value("kvstored_ram_held_bytes") == 0
    new.stop()


def test_a_chunk_leased_at_the_hand_over_stays_where_its_reader_reads_it(daemons, workdir, ns_name):
    """The vLLM direct spec's worker copies a chunk its scheduler leased whenever its GPU stream
    gets there, and vLLM takes every load as done: no check after the copy can help. The new
    daemon therefore leases again what each ended session had leased: another client filling
    the whole pool meanwhile evicts none of those chunks, and a read of their pages through the
    old mapping (the late copy) gets their bytes. Once the client names the session, they are
    ordinary chunks again."""
    old = make(daemons, workdir).start()
    mine, theirs = make_keys("leased", 4), make_keys("theirs", 320)  # (256 chunks fill the 16 MiB pool)
    with old.client() as a:
        ns = a.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert a.store(ns, mine, payloads(mine, CHUNK)).stored == 4
        session = a._session
        assert session.fast is not None
        request = pb.AcquireRequest(session_id=session.session_id, namespace_id=ns.namespace_id, keys=mine)
        leases = session.fast.call("Acquire", request, 10.0).leases
        assert len(leases) == 4
        new = make(daemons, workdir)
        hand_over(old, new, METRICS)
        with new.client() as b:
            ns_b = b.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
            for i in range(0, len(theirs), 32):
                b.store(ns_b, theirs[i : i + 32], payloads(theirs[i : i + 32], CHUNK))
            assert [t for t in b.lookup(ns_b, theirs).tiers].count(Tier.RAM) > 200  # (the pool is full)
            pool = session.pool
            late = [b"".join(bytes(pool[e.offset : e.offset + e.length]) for e in lease.extents) for lease in leases]
            assert late == [p.tobytes() for p in payloads(mine, CHUNK)], "a leased chunk's pages went to another"
            assert b.lookup(ns_b, mine).tiers == [Tier.RAM] * 4  # (held leased chunks stay cached)
            assert f"and 4 leased chunk(s) of ended session {session.session_id[:8]}" in new.log
            assert scrape(new).value("kvstored_ram_held_bytes") >= 4 * CHUNK  # (and the old session's slots)
            # The old client's next call fails over and names the old session: the leases end.
            after = make_keys("after", 2)
            a.store(ns, after, payloads(after, CHUNK))
            assert wait_for(
                lambda: f"held pages of ended session {session.session_id[:8]}: its client is done" in new.log
            )
            assert scrape(new).value("kvstored_ram_held_bytes") == 0
            more = make_keys("more", 320)
            for i in range(0, len(more), 32):
                b.store(ns_b, more[i : i + 32], payloads(more[i : i + 32], CHUNK))
            assert Tier.RAM not in b.lookup(ns_b, mine).tiers  # evicted like any other chunk
    new.stop()


def test_handover_off_starts_cold(daemons, workdir, ns_name):
    old = make(daemons, workdir).start()
    data = fill(old, ns_name)
    old.stop()
    new = make(daemons, workdir).start(["--handover", "false"])
    assert where(new, data) == ([Tier.NONE] * len(data["keys"]), [Tier.NONE] * len(data["tkeys"]))
    new.stop()


@pytest.mark.parametrize("step", ["requested", "quiesced", "snapshot", "sent"])
def test_old_daemon_killed_mid_handover(daemons, workdir, ns_name, step):
    """Killed before it sent everything, the new daemon starts cold (and finds on disk what
    the old one wrote down once quiesced); killed after, the new one has it all."""
    old = make(daemons, workdir).start(fs_args(workdir), env={PAUSE: step})
    data = fill(old, ns_name)
    new = make(daemons, workdir)
    new.spawn(fs_args(workdir))
    assert wait_for(lambda: stopped(old)), old.log
    old.kill()
    new.wait_ready()
    public, tenant = where(new, data)
    if step == "sent":
        assert public == [Tier.RAM] * len(public) and tenant == [Tier.RAM] * len(tenant), new.log
        assert "RAM tier adopted" in new.log
    else:
        assert "starting cold" in new.log
        assert Tier.RAM not in public + tenant
        if step != "requested":  # quiesced: its dirty chunks were written down first
            assert public == [Tier.FS] * len(public), new.log
    new.stop()


@pytest.mark.parametrize("step", ["received", "verified", "adopted"])
def test_new_daemon_killed_mid_adoption(daemons, workdir, ns_name, step):
    """The old daemon wrote its chunks down before handing over: a new one killed while adopting
    loses RAM, and the next start serves them from disk, byte-exact."""
    old = make(daemons, workdir).start(fs_args(workdir))
    data = fill(old, ns_name)
    new = make(daemons, workdir)
    new.spawn(fs_args(workdir), env={PAUSE: step})
    assert old.wait() == 0, old.log
    assert wait_for(lambda: stopped(new)), new.log
    new.kill()
    third = make(daemons, workdir).start(fs_args(workdir))
    public, _tenant = where(third, data)
    assert public == [Tier.FS] * len(public), third.log
    third.stop()


def memfd_of(d: Daemon, name: str) -> Path:
    for fd in Path(f"/proc/{d.pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith(f"/memfd:{name} "):
                return fd
        except OSError:
            continue
    raise AssertionError(f"no memfd {name} in {d}")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b", buffering=0) as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupted_state_is_refused_and_the_new_daemon_starts_cold(daemons, workdir, ns_name):
    old = make(daemons, workdir).start(env={PAUSE: "snapshot"})
    data = fill(old, ns_name)
    new = make(daemons, workdir)
    new.spawn()
    assert wait_for(lambda: stopped(old)), old.log
    state = memfd_of(old, "kvstored-handover-state")
    flip_byte(state, state.stat().st_size // 2)
    os.kill(old.pid, signal.SIGCONT)
    assert old.wait() == 0, old.log
    new.wait_ready()
    assert "checksum does not match" in new.log and "starting cold" in new.log
    assert where(new, data) == ([Tier.NONE] * len(data["keys"]), [Tier.NONE] * len(data["tkeys"]))
    new.stop()


def test_chunk_changed_after_the_snapshot_is_dropped_not_served(daemons, workdir, ns_name):
    old = make(daemons, workdir).start(env={PAUSE: "snapshot"})
    data = fill(old, ns_name, tenant_n=1)
    new = make(daemons, workdir)
    new.spawn()
    assert wait_for(lambda: stopped(old)), old.log
    # Every public chunk's first byte flips (the test cannot tell which slot holds which).
    pool = memfd_of(old, "kvstored-pool")
    for offset in range(0, 16 << 20, CHUNK):
        flip_byte(pool, offset)
    os.kill(old.pid, signal.SIGCONT)
    assert old.wait() == 0, old.log
    new.wait_ready()
    public, tenant = where(new, data)
    assert public == [Tier.NONE] * len(public), new.log
    assert tenant == [Tier.RAM], new.log  # (in its own arena, untouched)
    assert wait_for(lambda: SWEPT in new.log), new.log
    assert f"1 chunks ({CHUNK // 1024}.0 KiB) matched, {len(public)} dropped" in new.log
    new.stop()


SWEPT = "every adopted chunk verified"
METRICS = ["--metrics-addr", "127.0.0.1:0"]


def scrape(d: Daemon):
    from tests.integration.test_metrics import Scrape
    from tests.integration.test_metrics import scrape as get

    return Scrape(get(d))


def test_chunks_altered_after_adoption_before_their_first_load_are_misses_and_counted(daemons, workdir, ns_name):
    """The new daemon serves before it has checked the chunks' bytes: one altered after the
    hand-over (here: while the new daemon is stopped right after adopting the index, before
    serving) is a miss at its first load or at the sweep, whichever comes first, never wrong bytes."""
    old = make(daemons, workdir).start()
    data = fill(old, ns_name, tenant_n=1)
    new = make(daemons, workdir)
    new.spawn(METRICS, env={PAUSE: "adopted"})
    assert old.wait() == 0, old.log
    assert wait_for(lambda: stopped(new)), new.log
    assert "48 to verify before their first read" in new.log or "49 to verify" in new.log, new.log
    pool = memfd_of(new, "kvstored-pool")
    for offset in range(0, 16 << 20, CHUNK):  # every public chunk's first byte
        flip_byte(pool, offset)
    os.kill(new.pid, signal.SIGCONT)
    new.wait_ready()
    public, tenant = where(new, data)
    assert public == [Tier.NONE] * len(public), new.log
    assert tenant == [Tier.RAM], new.log
    assert wait_for(lambda: SWEPT in new.log), new.log
    m = scrape(new)
    assert m.value("kvstored_tier_checksum_failures_total", tier="ram", kind="ram") == len(public)
    assert m.value("kvstored_ram_verified_chunks_total") == 1
    assert m.value("kvstored_ram_unverified_chunks") == 0
    new.stop()


def test_the_sweep_verifies_every_adopted_chunk_and_the_next_stop_reuses_the_checksums(daemons, workdir, ns_name):
    old = make(daemons, workdir).start()
    data = fill(old, ns_name)
    n = len(data["keys"]) + len(data["tkeys"])
    new = make(daemons, workdir)
    hand_over(old, new, METRICS)
    # The old daemon took the checksums while still serving: its stop had none left to take.
    assert f"({n} chunk checksums taken while serving" in old.log and "chunk checksums: 0 computed" in old.log
    assert wait_for(lambda: SWEPT in new.log), new.log
    assert f"{n} chunks ({n * CHUNK // 1024 // 1024}.0 MiB) matched, 0 dropped" in new.log, new.log
    m = scrape(new)
    assert m.value("kvstored_ram_unverified_chunks") == 0
    assert m.value("kvstored_ram_verified_chunks_total") == n
    assert m.value("kvstored_ram_verified_bytes_total") == n * CHUNK
    assert m.value("kvstored_tier_checksum_failures_total", tier="ram", kind="ram") == 0
    # Verified (and now known), the next hand-over hashes only what was stored since.
    more = make_keys("after-adoption", 8)
    with new.client() as kv:
        ns = kv.register_namespace(model=data["model"], dtype="u8", chunk_bytes=CHUNK)
        assert kv.store(ns, more, payloads(more, CHUNK)).stored == len(more)
    newer = make(daemons, workdir)
    hand_over(new, newer)
    assert f"({len(more)} chunk checksums taken while serving" in new.log, new.log
    assert f"chunk checksums: 0 computed, {n + len(more)} known" in new.log
    assert where(newer, data) == ([Tier.RAM] * len(data["keys"]), [Tier.RAM] * len(data["tkeys"]))
    newer.stop()


def test_layout_mismatch_is_refused(daemons, workdir, ns_name):
    old = make(daemons, workdir).start()
    data = fill(old, ns_name)
    new = make(daemons, workdir, cpu_bytes="32MiB")
    hand_over(old, new)
    assert "cpu_bytes 16777216 (handed over) != 33554432 (configured)" in new.log
    assert where(new, data) == ([Tier.NONE] * len(data["keys"]), [Tier.NONE] * len(data["tkeys"]))
    new.stop()


def test_killed_daemon_leaves_nothing_to_adopt(daemons, workdir, ns_name):
    old = make(daemons, workdir).start(fs_args(workdir))
    data = fill(old, ns_name)
    old.kill()
    new = make(daemons, workdir).start(fs_args(workdir))
    assert "no daemon listens" in new.log and "adopted" not in new.log
    public, tenant = where(new, data)
    assert Tier.RAM not in public + tenant
    new.stop()


# -- systemd's fd store ----------------------------------------------------------------------------


def receive_notifications(sock: socket.socket) -> list[tuple[str, list[int]]]:
    got: list[tuple[str, list[int]]] = []
    sock.setblocking(False)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 16)
        except BlockingIOError:
            return got
        got.append((msg.decode(), fds))


def test_systemd_fd_store_keeps_ram_across_a_restart(daemons, workdir, ns_name):
    """systemd's protocol, played by the test: a datagram NOTIFY_SOCKET receives the fds the
    daemon stores at stop (FDSTORE=1, FDNAME=), and the next daemon gets them as systemd passes
    them (LISTEN_FDS from fd 3, LISTEN_FDNAMES, LISTEN_PID)."""
    notify_path = workdir / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    env = {"NOTIFY_SOCKET": str(notify_path), "FDSTORE": "64"}
    try:
        old = make(daemons, workdir).start(env=env)
        data = fill(old, ns_name)
        old.stop()
        stored = {}
        for text, fds in receive_notifications(sock):
            fields = dict(line.split("=", 1) for line in text.splitlines())
            if fields.get("FDSTORE") == "1":
                stored[fields["FDNAME"]] = fds[0]
        assert set(stored) == {"kvstored-pool", "kvstored-state", "kvstored-arena-1"}, stored
        new = make(daemons, workdir)
        new.spawn(env=env, listen_fds=stored)
        new.wait_ready()
        for fd in stored.values():
            os.close(fd)
        public, tenant = where(new, data)
        assert public == [Tier.RAM] * len(public) and tenant == [Tier.RAM] * len(tenant), new.log
        assert "handed over by systemd's fd store" in new.log
        removed = [t for t, _ in receive_notifications(sock) if t.startswith("FDSTOREREMOVE=1")]
        assert sorted(removed) == sorted(f"FDSTOREREMOVE=1\nFDNAME={name}" for name in stored)
        new.stop()
    finally:
        sock.close()
