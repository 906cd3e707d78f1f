# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""`pip install ./client` from a plain checkout: the generated protobuf modules are not in git, so
the build must make them (the systemd recipe and the vLLM plugin install it this way)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.support.daemon import REPO_ROOT


def test_client_wheel_built_from_a_checkout_carries_the_generated_modules(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO_ROOT / "proto", src / "proto")
    shutil.copytree(
        REPO_ROOT / "client",
        src / "client",
        ignore=shutil.ignore_patterns("*_pb2*.py", "*_pb2*.pyi", "*.egg-info", "build", "__pycache__"),
    )
    assert not list((src / "client").rglob("*_pb2.py"))  # as git has it
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src / "client"),
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("kvstored_client-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("kvstored_pb2.py", "kvstored_pb2_grpc.py"):
        assert f"kvstored_client/_gen/kvstored/v1/{module}" in names
    if shutil.which("cc") or shutil.which("gcc"):  # the optional copy helper is built where it can be
        assert any(n.startswith("kvstored_client/_ntcopy.") and n.endswith(".so") for n in names), names

    # And from an sdist, which has no ../proto: it must carry the generated modules itself.
    subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist")],
        cwd=src / "client",
        check=True,
        timeout=300,
        capture_output=True,
    )
    sdist = next((tmp_path / "sdist").glob("kvstored_client-*.tar.gz"))
    shutil.unpack_archive(sdist, tmp_path / "unpacked")
    unpacked = next((tmp_path / "unpacked").iterdir())
    assert (unpacked / "kvstored_client" / "_ntcopy.c").exists()  # the helper's source travels with it
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(unpacked),
            "-w",
            str(tmp_path / "from-sdist"),
        ],
        check=True,
        timeout=300,
    )
    from_sdist = next((tmp_path / "from-sdist").glob("kvstored_client-*.whl"))
    assert "kvstored_client/_gen/kvstored/v1/kvstored_pb2.py" in zipfile.ZipFile(from_sdist).namelist()

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb; "
            "print(pb.RegionTransferRequest(start_within_ms=5).start_within_ms)",
        ],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert probe.returncode == 0 and probe.stdout.strip() == "5", probe.stderr
