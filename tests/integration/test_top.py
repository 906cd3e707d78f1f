# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""`kvstoredctl top` against a real daemon under load: --once (text and JSON) for scripts, and the
live view driven in a real terminal (tmux): tier rows with rates, a resize, q and Ctrl-C."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.daemon import clean_env, short_tmpdir

CHUNK = 256 << 10
KEYS = 128  # 32 MiB: twice the RAM tier, so chunks keep moving between RAM and fs
CTL = [sys.executable, "-m", "kvstored.ctl"]
RATE_COLUMNS = ("LOOKUP/s", "IN/s", "OUT/s", "PROMO/s", "EVICT/s")
WAIT_S = 60.0  # only stops a hang: every wait below is for a state


class Load:
    """A client on a thread storing, loading and looking up chunks in a cycle until stopped: the RAM
    tier evicts to fs, and lookups of older chunks promote them back."""

    def __init__(self, daemon) -> None:
        self._daemon = daemon
        self._stop = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="top-load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            with self._daemon.client() as kv:
                ns = kv.register_namespace(model="top-load", dtype="u8", chunk_bytes=CHUNK)
                keys = [i.to_bytes(32, "big") for i in range(KEYS)]
                data = np.arange(8 * CHUNK, dtype=np.uint64).astype(np.uint8).reshape(8, CHUNK)
                out = np.empty_like(data)
                while not self._stop.is_set():
                    new = keys[(self.rounds * 8) % KEYS :][:8]
                    old = keys[((self.rounds + 6) * 8) % KEYS :][:8]
                    kv.store(ns, new, data)
                    kv.load(ns, new, out)
                    kv.lookup(ns, old)
                    kv.load(ns, old, out)
                    self.rounds += 1
        except BaseException as exc:  # surfaced by __exit__
            self.error = exc


@pytest.fixture
def laddered(daemon_factory):
    root = short_tmpdir("kvtop")
    d = daemon_factory(["--tiers", f"kind=fs,root={root},bytes=256MiB"], cpu_bytes="16MiB")
    yield d
    shutil.rmtree(root, ignore_errors=True)


def ctl(*args: str, socket_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        CTL + ["--socket", str(socket_path), *args], capture_output=True, text=True, timeout=60, env=clean_env()
    )


def table_rows(lines: list[str]) -> dict[str, dict[str, str]]:
    """{tier: {column: value}} from a rendered frame (values have no spaces)."""
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["TIER"])
    header = lines[start].split()
    rows = {}
    for line in lines[start + 1 :]:
        cells = line.split()
        if len(cells) == len(header):
            rows[cells[0]] = dict(zip(header, cells))
    return rows


def moving(row: dict[str, str]) -> bool:
    return any(row[c] not in ("0", "-") for c in RATE_COLUMNS)


def test_once_prints_one_frame_with_rates(laddered):
    with Load(laddered):
        proc = ctl("top", "--once", "--interval", "0.5", socket_path=laddered.socket)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith("kvstored ") and f"on {laddered.socket}" in lines[0] and "rates over" in lines[0]
        assert lines[1].split()[0::2] == ["sessions", "leases", "reservations", "regions", "namespaces"]
        rows = table_rows(lines)
        assert list(rows) == ["ram", "fs"]
        assert rows["ram"]["IN/s"] != "0" and moving(rows["fs"]), proc.stdout

        proc = ctl("top", "--once", "--json", "--interval", "0.5", socket_path=laddered.socket)
        assert proc.returncode == 0, proc.stderr
        frame = json.loads(proc.stdout)
    assert frame["socket"] == str(laddered.socket) and frame["sessions"] >= 1 and frame["interval_s"] > 0
    ram, fs = frame["tiers"]
    assert (ram["name"], fs["name"], ram["kind"], fs["kind"]) == ("ram", "fs", "ram", "fs")
    assert ram["in_bytes_per_s"] > 0 and ram["lookups_per_s"] > 0
    assert fs["lookups_per_s"] > 0 and fs["capacity_bytes"] == 256 << 20
    stats = {t.name: t for t in laddered.stats().tiers}
    assert ram["capacity_bytes"] == stats["ram"].capacity_bytes and ram["lookups"] <= stats["ram"].lookups


def test_bad_use_is_exit_2(laddered):
    for args, message in (
        (["--interval", "0"], "--interval must be > 0"),
        (["--json"], "--json needs --once"),
        ([], "the live view needs a terminal"),
    ):  # stdout here is a pipe
        proc = ctl("top", *args, socket_path=laddered.socket)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_daemon_down_is_one_line(tmp_path):
    proc = ctl("top", "--once", socket_path=tmp_path / "none.sock")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"kvstoredctl: cannot reach kvstored at {tmp_path / 'none.sock'}: no such socket")


class Tmux:
    """A private tmux server (its own socket, no user config). A command runs in a shell that
    records, once it ends, its exit code and the terminal's modes (`stty -a`) in files: what the
    pane shows after a process ends, and #{pane_dead_status}, are not reliable in tmux 3.3."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("tmux")
        if exe is None:
            pytest.fail("tmux not found: run deploy/install-system-deps.sh (Debian package tmux)", pytrace=False)
        self._dir = workdir
        self._base = [exe, "-S", str(workdir / "tmux.sock"), "-f", str(workdir / "tmux.conf")]
        (workdir / "tmux.conf").write_text("set -g remain-on-exit on\nset -g history-limit 0\n")

    def __call__(self, *args: str) -> str:
        out = subprocess.run(self._base + list(args), capture_output=True, text=True, timeout=30, env=clean_env())
        assert out.returncode == 0, f"tmux {' '.join(args)}: {out.stderr}"
        return out.stdout

    def start(self, name: str, argv: list[str], width: int, height: int) -> None:
        done = self._dir / f"{name}.exit"
        modes = self._dir / f"{name}.stty"
        self(
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            str(width),
            "-y",
            str(height),
            f"{shlex.join(argv)}; code=$?; stty -a > {shlex.quote(str(modes))}; "
            f"echo $code > {shlex.quote(str(done))}.tmp; mv {shlex.quote(str(done))}.tmp {shlex.quote(str(done))}",
        )

    def screen(self, name: str) -> list[str]:
        return self("capture-pane", "-p", "-t", name).splitlines()

    def exit_code(self, name: str) -> int | None:
        done = self._dir / f"{name}.exit"
        return int(done.read_text()) if done.exists() else None

    def terminal_modes(self, name: str) -> list[str]:
        return (self._dir / f"{name}.stty").read_text().split()

    def wait_for(self, name: str, predicate, what: str):
        deadline = time.monotonic() + WAIT_S
        while True:
            lines = self.screen(name)
            if result := predicate(lines):
                return result
            assert self.exit_code(name) is None, f"top exited while waiting for {what}:\n" + "\n".join(lines)
            assert time.monotonic() < deadline, f"timed out waiting for {what}; the screen:\n" + "\n".join(lines)
            time.sleep(0.1)

    def wait_exit(self, name: str) -> int:
        deadline = time.monotonic() + WAIT_S
        while (code := self.exit_code(name)) is None:
            assert time.monotonic() < deadline, "top did not exit:\n" + "\n".join(self.screen(name))
            time.sleep(0.05)
        return code

    def kill(self) -> None:
        subprocess.run(self._base + ["kill-server"], capture_output=True, timeout=30)


@pytest.mark.system_deps
def test_live_view_in_a_terminal(laddered, tmp_path):
    tmux = Tmux(tmp_path)
    argv = CTL + ["--socket", str(laddered.socket), "top", "--interval", "0.3"]
    try:
        with Load(laddered) as load:
            tmux.start("top", argv, 140, 20)

            def both_tiers_moving(lines):
                try:
                    rows = table_rows(lines)
                except StopIteration:
                    return None
                return rows if set(rows) == {"ram", "fs"} and all(map(moving, rows.values())) else None

            rows = tmux.wait_for("top", both_tiers_moving, "ram and fs rows with non-zero rates")
            assert rows["ram"]["IN/s"] != "0" and rows["ram"]["KIND"] == "ram" and rows["fs"]["KIND"] == "fs"
            screen = tmux.screen("top")
            assert screen[0].startswith("kvstored ") and "sessions" in screen[1]

            # 80 columns: the table sheds its least needed columns instead of being cut.
            tmux("resize-window", "-t", "top", "-x", "80", "-y", "20")

            def fits_80(lines):
                header = next((line for line in lines if line.startswith("TIER")), "")
                rows = table_rows(lines) if header else {}
                return rows if header.rstrip().endswith("DROP/s") and set(rows) == {"ram", "fs"} else None

            narrow = tmux.wait_for("top", fits_80, "a table that fits 80 columns, DROP/s last")
            assert all("IN/s" in row and "DROP/s" in row for row in narrow.values())

            # A narrower, shorter terminal: still drawing (new frames come), clipped to the width.
            tmux("resize-window", "-t", "top", "-x", "50", "-y", "8")
            before = screen[0].split()[4]  # the clock

            def redrawn_narrow(lines):
                head = lines[0] if lines else ""
                return head.startswith("kvstored ") and len(head) < 50 and head.split()[4:5] != [before]

            tmux.wait_for("top", redrawn_narrow, "a frame drawn for 50 columns")
            tmux("resize-window", "-t", "top", "-x", "140", "-y", "20")
            tmux.wait_for(
                "top",
                lambda lines: any(line.rstrip().endswith("EVICT/s") for line in lines),
                "the full table again after widening",
            )

            # q, then (a second view) Ctrl-C: exit 0, and curses gave the terminal its modes back
            tmux("send-keys", "-t", "top", "q")
            assert tmux.wait_exit("top") == 0
            tmux.start("top2", argv, 140, 20)
            tmux.wait_for("top2", both_tiers_moving, "the second view's rows")
            tmux("send-keys", "-t", "top2", "C-c")
            assert tmux.wait_exit("top2") == 0
            for name in ("top", "top2"):
                modes = tmux.terminal_modes(name)
                assert "icanon" in modes and "echo" in modes and "-icanon" not in modes, (name, modes)
        assert load.rounds > 0
    finally:
        tmux.kill()
