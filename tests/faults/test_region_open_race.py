# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""RegisterRegion by path while a process swaps a directory of that path for a symlink leading
outside `region_dirs` (issue #12, defect 2).

The daemon used to resolve the path, check it, then open it: a swap in between made it open (and
later write) the file outside. Each attempt's outcome is read from the file the daemon opened:
the two candidate files differ in size, and RegisterRegion answers the size of the inode it
mapped, so an outside open cannot hide whatever the timing."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import grpc

from tests.support.daemon import REPO_ROOT, short_tmpdir
from tests.support.rpc import RawConn, make_region_file, pb

INSIDE_BYTES = 64 << 10
OUTSIDE_BYTES = 128 << 10
MIN_ATTEMPTS = 2000
MIN_EACH = 50  # inside opens and refusals each, or the race was not really run
MAX_ATTEMPTS = 20_000
REGIONS_PER_SESSION = 200  # regions live as long as their session: rotate, so fds don't pile up


def test_register_region_never_opens_through_a_swapped_symlink(daemon_factory):
    base = short_tmpdir("kvrace")
    allowed, outside = base / "allowed", base / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    make_region_file(allowed / "sub", "f", INSIDE_BYTES)
    secret = make_region_file(outside, "f", OUTSIDE_BYTES)
    secret.write_bytes(b"s" * OUTSIDE_BYTES)
    (allowed / "alt").symlink_to(outside)
    d = daemon_factory(["--region-dirs", str(allowed)])

    # allowed/sub and allowed/alt trade places atomically: sub is the directory or the symlink
    swapper = subprocess.Popen(
        [sys.executable, "-m", "tests.support.swap", str(allowed / "sub"), str(allowed / "alt")],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    outcomes: Counter[str] = Counter()
    request_path = str(allowed / "sub" / "f")
    conn: RawConn | None = None
    attempts = 0
    try:
        assert swapper.stdout.readline().strip() == "ready"
        while attempts < MAX_ATTEMPTS and (
            attempts < MIN_ATTEMPTS or outcomes["inside"] < MIN_EACH or outcomes["PERMISSION_DENIED"] < MIN_EACH
        ):
            if attempts % REGIONS_PER_SESSION == 0:
                if conn is not None:
                    conn.close()
                conn = RawConn(d.socket)
            try:
                size = conn.call(
                    "RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=request_path)
                ).size
                outcomes[{INSIDE_BYTES: "inside", OUTSIDE_BYTES: "outside"}.get(size, f"size {size}")] += 1
            except grpc.RpcError as exc:
                outcomes[exc.code().name] += 1
            attempts += 1
    finally:
        swapper.stdin.close()
        swaps = swapper.stdout.read().strip()
        swapper.wait()
        if conn is not None:
            conn.close()
        subprocess.run(["rm", "-rf", str(base)], check=False)
    print(f"\n{attempts} RegisterRegion attempts during {swaps} swaps: {dict(outcomes)}")
    assert swapper.returncode == 0
    assert outcomes["outside"] == 0, f"the daemon opened the file outside region_dirs: {dict(outcomes)}"
    assert outcomes["inside"] >= MIN_EACH and outcomes["PERMISSION_DENIED"] >= MIN_EACH, (
        f"the race was not exercised: {dict(outcomes)}"
    )
    assert set(outcomes) == {"inside", "PERMISSION_DENIED"}, dict(outcomes)
