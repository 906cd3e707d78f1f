# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Running as a service: the systemd unit verifies and its ExecStart line serves with sd_notify,
the example config documents and accepts every option, SIGHUP reloads what it can, and logs
are one line per notable event (JSON when asked)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstored.config import Config, load_config
from kvstored.tiers.config import FsTierConfig, PeerTierConfig, S3TierConfig
from kvstored.tiers.registry import KINDS
from tests.support.daemon import REPO_ROOT, clean_env, kvstored_command, short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.s3 import MotoServer

MIB = 1 << 20
UNIT = REPO_ROOT / "deploy" / "systemd" / "kvstored.service"
EXAMPLE = REPO_ROOT / "deploy" / "kvstored.example.toml"
WAIT_S = 30.0


def unit_values(key: str) -> list[str]:
    """Every value of `key=` in the [Service] section of the unit."""
    section, values = "", []
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line.startswith(f"{key}="):
            values.append(line.split("=", 1)[1])
    return values


def unit_value(key: str) -> str:
    values = unit_values(key)
    assert len(values) == 1, f"{key}= appears {len(values)} times in {UNIT}"
    return values[0]


def wait_for(predicate, what: str, log=lambda: ""):
    """Poll until `predicate()` is truthy (a state, not a time: the deadline only stops a hang)."""
    deadline = time.monotonic() + WAIT_S
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{log()}"
        time.sleep(0.05)
    return result


# -- the unit --------------------------------------------------------------------------------------


@pytest.mark.system_deps
def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze not found (Debian package systemd)"
    # A root with the system's unit files, the unit installed, and its commands where it names them.
    root = tmp_path / "root"
    system_units = Path("/usr/lib/systemd/system")
    shutil.copytree(system_units, root / system_units.relative_to("/"), symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system" / UNIT.name)
    for key in ("ExecStart", "ExecReload"):
        binary = Path(shlex.split(unit_value(key))[0])
        stub = root / binary.relative_to("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    proc = subprocess.run(
        [analyze, "verify", f"--root={root}", "--man=no", UNIT.name], capture_output=True, text=True, timeout=60
    )
    # verify exits 0 on unknown keys and unparsable values, but says so: no output is the pass.
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        f"systemd-analyze verify:\n{proc.stdout}{proc.stderr}"
    )


def test_unit_settings():
    assert unit_value("Type") == "notify"
    assert unit_value("RuntimeDirectory") == "kvstored"
    assert (unit_value("User"), unit_value("Group")) == ("kvstored", "kvstored")
    assert unit_value("LimitMEMLOCK") == "infinity"
    assert unit_value("ProtectSystem") == "strict"
    assert unit_value("NoNewPrivileges") == "true" and unit_value("PrivateTmp") == "true"
    assert "/var/cache/kvstored" in unit_value("ReadWritePaths").split()
    argv = shlex.split(unit_value("ExecStart"))
    assert argv[argv.index("--socket") + 1] == "/run/kvstored/kvstored.sock"
    assert argv[argv.index("--socket-mode") + 1] == "0660"


def test_exec_start_notifies_ready_when_serving_and_stops_on_sigterm():
    work = short_tmpdir("kvsd")
    notify_path = work / "notify.sock"
    run_dir = work / "run"
    run_dir.mkdir()
    config = work / "kvstored.toml"
    shutil.copy(EXAMPLE, config)
    argv = [
        arg.replace("/run/kvstored", str(run_dir)).replace("/etc/kvstored/kvstored.toml", str(config))
        for arg in shlex.split(unit_value("ExecStart"))
    ]
    argv[:1] = kvstored_command()  # the venv's kvstored for /opt/kvstored/bin/kvstored
    sock = run_dir / "kvstored.sock"
    log_path = work / "daemon.log"
    # The example's 16 GiB RAM tier and fixed metrics port are for a real node: override by env.
    env = clean_env(
        {"NOTIFY_SOCKET": str(notify_path), "KVSTORED_CPU_BYTES": "32MiB", "KVSTORED_METRICS_ADDR": "127.0.0.1:0"}
    )
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(WAIT_S)
    proc = None
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        read_log = log_path.read_text

        def next_message() -> str:
            try:
                return notify.recv(4096).decode()
            except TimeoutError:
                pytest.fail(f"no sd_notify message within {WAIT_S}s:\n{read_log()}")

        ready = next_message()
        while ready.startswith("STATUS=populating the RAM tier"):  # start-up progress comes first
            assert "EXTEND_TIMEOUT_USEC=" in ready, ready
            ready = next_message()
        assert "READY=1" in ready.splitlines(), ready
        with grpc.insecure_channel(f"unix:{sock}") as channel:  # serving the moment READY=1 arrives
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        assert stat.S_IMODE(os.stat(f"{sock}.session").st_mode) == 0o660

        proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in next_message().splitlines()
        assert proc.wait(WAIT_S) == 0, read_log()
        assert not sock.exists() and not Path(f"{sock}.session").exists()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
        shutil.rmtree(work, ignore_errors=True)


# -- the example config ------------------------------------------------------------------------------

SETTING = re.compile(r"^#\s?((?:\[\[tiers\]\])|(?:[a-z_]+\s*=\s*\S.*))$")


def uncommented_example() -> str:
    """The example with every commented-out setting switched on."""
    return "\n".join(m[1] if (m := SETTING.match(line)) else line for line in EXAMPLE.read_text().splitlines())


def test_example_config_documents_and_accepts_every_option(tmp_path):
    text = EXAMPLE.read_text()
    for f in dataclasses.fields(Config):
        assert re.search(rf"^#?\s?({f.name}\s*=|\[\[{f.name}\]\])", text, re.M), (
            f"option {f.name} missing from {EXAMPLE.name}"
        )
    for kind in KINDS.values():
        for f in dataclasses.fields(kind.config):
            assert re.search(rf"^#\s?{f.name}\s*=", text, re.M), f"tier key {f.name} missing from {EXAMPLE.name}"

    as_shipped = load_config(env={}, config_file=EXAMPLE)
    assert as_shipped.cpu_bytes == 16 << 30 and as_shipped.tiers == ()
    # ... which the docs say, and none speaks of a default root the example does not enable
    assert "The example config enables no tier below RAM" in (REPO_ROOT / "docs" / "operations.md").read_text()
    for doc in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        assert "default root" not in doc.read_text(), doc

    full = tmp_path / "full.toml"
    full.write_text(uncommented_example())
    cfg = load_config(env={}, config_file=full)
    fs, s3, peer = cfg.tiers
    assert isinstance(fs, FsTierConfig) and fs.root == Path("/var/cache/kvstored") and fs.bytes == 500 << 30
    assert isinstance(s3, S3TierConfig) and s3.bucket == "kvcache"
    assert isinstance(peer, PeerTierConfig) and peer.peers == ("10.0.0.2:7070", "10.0.0.3:7070")
    assert cfg.socket == Path("/run/kvstored/kvstored.sock") and cfg.socket_mode == 0o660
    assert cfg.metrics_addr == "127.0.0.1:9464"


# -- SIGHUP ------------------------------------------------------------------------------------------


def test_sighup_applies_log_level_and_every_tiers_admission_and_names_the_rest(daemon_factory):
    root = short_tmpdir("kvhup")
    config = root / "kvstored.toml"
    moto = MotoServer()
    endpoint = moto.start()

    def write(log_level: str, admission: str, grace: float) -> None:
        config.write_text(
            f'log_level = "{log_level}"\ngrace_seconds = {grace}\n'
            f'[[tiers]]\nkind = "fs"\nroot = "{root / "fs"}"\nbytes = "64MiB"\nadmission = "{admission}"\n'
            f'[[tiers]]\nkind = "s3"\nbucket = "hup"\nendpoint_url = "{endpoint.url}"\nregion = "{endpoint.region}"\n'
            f'access_key = "{endpoint.access_key}"\nsecret_key = "{endpoint.secret_key}"\nadmission = "{admission}"\n'
        )

    try:
        write("info", "always", 5.0)
        d = daemon_factory(["--config", str(config), "--metrics-addr", "off"], cpu_bytes="4MiB")
        keys = make_keys("hup", 12)
        with d.client() as kv:
            ns = kv.register_namespace(model="hup", dtype="uint8", chunk_bytes=MIB)
            for i in range(0, 6, 2):
                kv.store(ns, keys[i : i + 2], payloads(keys[i : i + 2], MIB))
            wait_for(lambda: all(t.stored_chunks for t in d.stats().tiers[1:]), "write-downs", lambda: d.log)
            assert [t.rejected_admission for t in d.stats().tiers[1:]] == [0, 0]

            write("debug", "second-eviction", 7.0)
            os.kill(d.pid, signal.SIGHUP)
            wait_for(lambda: "SIGHUP: configuration reloaded" in d.log, "the reload", lambda: d.log)
            assert (
                "applied: log_level=debug log_format=text; tier fs admission=second-eviction; "
                "tier s3 admission=second-eviction"
            ) in d.log
            assert re.search(r"SIGHUP: grace_seconds changed but can only take effect after a restart", d.log)

            for i in range(6, 12, 2):  # new chunks are now refused by both tiers the first time
                kv.store(ns, keys[i : i + 2], payloads(keys[i : i + 2], MIB))
            wait_for(
                lambda: all(t.rejected_admission for t in d.stats().tiers[1:]), "admission refusals", lambda: d.log
            )

        config.write_text("log_level = [broken\n")
        os.kill(d.pid, signal.SIGHUP)
        wait_for(lambda: "SIGHUP: configuration not reloaded" in d.log, "the refusal", lambda: d.log)
        assert "not valid TOML" in d.log and "line 1" in d.log  # where in the file
        assert d.stats().tiers[0].name == "ram"  # still serving
    finally:
        moto.stop()
        shutil.rmtree(root, ignore_errors=True)


# -- logs --------------------------------------------------------------------------------------------


def test_json_logs_one_line_per_notable_event(daemon_factory):
    d = daemon_factory(["--log-format", "json", "--metrics-addr", "127.0.0.1:0"], cpu_bytes="8MiB")

    def records() -> list[dict]:
        lines = d.log.splitlines()
        assert lines, "the daemon logged nothing"
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                pytest.fail(f"not a JSON log line: {line!r}")
            assert {"ts", "level", "logger", "msg"} <= rec.keys(), rec
            out.append(rec)
        return out

    def info_lines() -> int:
        return sum(1 for r in records() if r["level"] == "info")

    def workload(kv, ns, label: str, batches: int) -> None:
        out = np.empty((4, MIB), np.uint8)
        for b in range(batches):
            keys = make_keys(f"{label}-{b}", 4)
            assert kv.store(ns, keys, payloads(keys, MIB)).stored == 4
            assert kv.lookup(ns, keys).prefix_hits == 4
            assert kv.load(ns, keys, out) == 4

    with d.client() as kv:
        ns = kv.register_namespace(model="logs", dtype="uint8", chunk_bytes=MIB)
        workload(kv, ns, "small", 2)
        after_small = info_lines()
        workload(kv, ns, "large", 20)  # 10x the chunks, evictions included: no more INFO lines
        assert info_lines() == after_small, [r["msg"] for r in records()]
    d.stop()
    recs = records()
    msgs = [r["msg"] for r in recs]
    assert any(m.startswith("serving on ") for m in msgs) and msgs[-1] == "stopped"
    assert any(m.startswith("metrics on http://127.0.0.1:") for m in msgs)
    assert sum(1 for r in recs if r["level"] == "info") <= 12, msgs
    assert not [r for r in recs if r["level"] in ("warning", "error")], msgs
