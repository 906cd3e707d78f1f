# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Clients run as another user (root tests): the uid and group they take, and a socket directory
only that group reaches, as /run/kvstored is under systemd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.daemon import REPO_ROOT, clean_env, short_tmpdir

NOBODY = 65534
OTHER_GROUP = 1  # "daemon" on Debian: a group the unprivileged client is put in only where a test says


def run_script(script: str, *args: str) -> Any:
    """`python -c script args...` (the script drops to the other user itself, after its imports:
    the interpreter lives where that user cannot read); the JSON its last line prints."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def group_only_socket_dir(prefix: str) -> Path:
    """A socket directory owned by root and OTHER_GROUP, 2750: the daemon's sockets get that group."""
    sock_dir = short_tmpdir(prefix)
    os.chown(sock_dir, 0, OTHER_GROUP)
    os.chmod(sock_dir, 0o2750)
    return sock_dir
