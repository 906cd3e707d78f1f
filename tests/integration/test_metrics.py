# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""/metrics of a real daemon: values equal the Stats RPC, names pass promtool, and the shipped
dashboard, alerting rules and scrape config only use names a real scrape has."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstored.chunks import chunkfile
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.support.daemon import REPO_ROOT, clean_env, short_tmpdir
from tests.support.data import make_keys, payloads
from tests.support.rpc import raw, rpc_error
from tests.support.s3 import MotoServer
from tests.support.wait import wait_for

MIB = 1 << 20
DEPLOY = REPO_ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvstored-dashboard.json"
RULES = DEPLOY / "prometheus" / "kvstored.rules.yml"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
METRICS_LINE = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")
METRICS_PORT_0 = ["--metrics-addr", "127.0.0.1:0"]

# Every TierStats field and the metric that exports it (drops carry a reason label).
TIER_GAUGES = {
    "capacity_bytes": "kvstored_tier_capacity_bytes",
    "used_bytes": "kvstored_tier_used_bytes",
    "chunks": "kvstored_tier_chunks",
    "queued": "kvstored_tier_queued_operations",
    "load_bytes_per_s": "kvstored_tier_load_rate_bytes_per_second",
    "packs": "kvstored_tier_packs",
    "packed_bytes": "kvstored_tier_packed_bytes",
    "packed_live_bytes": "kvstored_tier_packed_live_bytes",
}
TIER_COUNTERS = {
    "lookups": "kvstored_tier_lookups_total",
    "hits": "kvstored_tier_hits_total",
    "evictions": "kvstored_tier_evictions_total",
    "stored_chunks": "kvstored_tier_stored_chunks_total",
    "loaded_chunks": "kvstored_tier_loaded_chunks_total",
    "read_bytes": "kvstored_tier_read_bytes_total",
    "written_bytes": "kvstored_tier_written_bytes_total",
    "promotions": "kvstored_tier_promotions_total",
    "writedowns": "kvstored_tier_writedowns_total",
    "checksum_failures": "kvstored_tier_checksum_failures_total",
    "bad_entries": "kvstored_tier_bad_entries_total",
    "skipped_slow_hits": "kvstored_tier_skipped_slow_hits_total",
    "skipped_slow_writedowns": "kvstored_tier_skipped_slow_writedowns_total",
    "rate_probes": "kvstored_tier_rate_probes_total",
    "packs_written": "kvstored_tier_packs_written_total",
    "packs_expired": "kvstored_tier_packs_expired_total",
    "packs_dropped": "kvstored_tier_packs_dropped_total",
}
LIVE_BANDS = ("0-25%", "25-50%", "50-75%", "75-100%")  # packs_by_live_quarter, as the band label
TIER_DROPS = {
    "dropped_backpressure": "backpressure",
    "rejected_admission": "admission",
    "rejected_full": "disk_full",
    "errors": "error",
    "dropped_dirty": "dirty_eviction",
}
PROMETHEUS_LABELS = {"instance", "job"}  # added by Prometheus at scrape time


# -- helpers ------------------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run deploy/install-system-deps.sh (Debian package prometheus)", pytrace=False)
    return path


def run_promtool(*args: str, stdin: str | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run([promtool(), *args], input=stdin, capture_output=True, text=True, cwd=cwd, timeout=60)
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout + proc.stderr


def metrics_url(daemon) -> str:
    match = METRICS_LINE.search(daemon.log)
    assert match, f"no 'metrics on http://...' line in the daemon log:\n{daemon.log}"
    return f"http://127.0.0.1:{match[1]}/metrics"


def scrape(daemon) -> str:
    with urllib.request.urlopen(metrics_url(daemon), timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


class Scrape:
    """Parsed exposition text: sample values by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[str, dict[frozenset, float]] = defaultdict(dict)
        self.label_names: dict[str, set[str]] = defaultdict(set)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[s.name][frozenset(s.labels.items())] = s.value
                self.label_names[s.name].update(s.labels)

    def value(self, name: str, **labels: str) -> float:
        series = self.samples.get(name, {})
        key = frozenset(labels.items())
        assert key in series, f"no sample {name}{labels}; have {sorted(map(str, map(dict, series)))}"
        return series[key]

    def series(self, name: str) -> dict[frozenset, float]:
        return self.samples.get(name, {})


def quiet_stats(daemon, deadline_s: float = 30.0) -> pb.StatsResponse:
    """Stats once background work (write-downs, promotions) has settled: two equal reads with
    nothing queued. Waits for a state, not for a time."""
    deadline = time.monotonic() + deadline_s
    prev = None
    while True:
        cur = daemon.stats()
        if prev is not None and cur.tiers == prev.tiers and all(t.queued == 0 for t in cur.tiers):
            return cur
        assert time.monotonic() < deadline, f"tier counters still moving after {deadline_s}s: {cur}"
        prev = cur
        time.sleep(0.05)


def assert_tiers_match(scraped: Scrape, stats: pb.StatsResponse) -> None:
    mapped = set(TIER_GAUGES) | set(TIER_COUNTERS) | set(TIER_DROPS) | {"name", "kind", "packs_by_live_quarter"}
    unexported = {f.name for f in pb.TierStats.DESCRIPTOR.fields} - mapped
    assert not unexported, f"TierStats fields with no metric: {unexported} (export them in metrics.py)"
    names = set()
    for t in stats.tiers:
        labels = {"tier": t.name, "kind": pb.TierKind.Name(t.kind).removeprefix("TIER_KIND_").lower()}
        names.add(t.name)
        for field, metric in {**TIER_GAUGES, **TIER_COUNTERS}.items():
            assert scraped.value(metric, **labels) == getattr(t, field), (metric, labels)
        for field, reason in TIER_DROPS.items():
            assert scraped.value("kvstored_tier_drops_total", **labels, reason=reason) == getattr(t, field)
        assert scraped.value("kvstored_tier_misses_total", **labels) == t.lookups - t.hits
        bands = {
            dict(k)["band"]: v
            for k, v in scraped.series("kvstored_tier_packs_by_live_fraction").items()
            if dict(k)["tier"] == t.name
        }
        assert bands == dict(zip(LIVE_BANDS, t.packs_by_live_quarter)), (t.name, bands)
        if t.capacity_bytes:
            assert scraped.value("kvstored_tier_utilization_ratio", **labels) == pytest.approx(
                t.used_bytes / t.capacity_bytes
            )
    assert {dict(k)["tier"] for k in scraped.series("kvstored_tier_capacity_bytes")} == names


def assert_histograms_consistent(scraped: Scrape, name: str) -> None:
    """Buckets cumulative, +Inf bucket == _count, for every series of histogram `name`."""
    by_series: dict[frozenset, list[tuple[float, float]]] = defaultdict(list)
    for labels, value in scraped.series(f"{name}_bucket").items():
        d = dict(labels)
        le = float(d.pop("le"))
        by_series[frozenset(d.items())].append((le, value))
    assert by_series, f"no {name} series"
    for labels, buckets in by_series.items():
        counts = [v for _, v in sorted(buckets)]
        assert counts == sorted(counts), (name, dict(labels), buckets)
        assert max(buckets)[1] == scraped.value(f"{name}_count", **dict(labels))


# -- RAM only -----------------------------------------------------------------------------------


@pytest.mark.system_deps
def test_ram_metrics_match_stats_and_pass_promtool(daemon_factory):
    d = daemon_factory(METRICS_PORT_0, cpu_bytes="8MiB")
    a, b = make_keys("metrics-a", 6), make_keys("metrics-b", 6)
    with d.client() as kv:
        ns = kv.register_namespace(model="metrics-ram", dtype="uint8", chunk_bytes=MIB)
        assert kv.store(ns, a, payloads(a, MIB)).stored == 6
        out = np.empty((4, MIB), np.uint8)
        assert kv.load(ns, a[:4], out) == 4
        assert kv.lookup(ns, a + b[:4]).prefix_hits == 6
        assert kv.store(ns, b, payloads(b, MIB)).stored == 6  # 8 MiB of RAM: evicts 4 of `a`
        assert kv.delete(ns, b[:2]) == 2
        with raw(d.socket, session=False) as conn:
            rpc_error(conn.call, "Lookup", pb.LookupRequest(namespace_id="0" * 32, keys=[b"k" * 32]))
        # grpc.aio sends an aborted call's status before the interceptor around it counts the call
        not_found = frozenset({"service": "kvstored.v1.KVStore", "method": "Lookup", "code": "NOT_FOUND"}.items())
        assert wait_for(
            lambda: not_found in Scrape(scrape(d)).samples.get("kvstored_grpc_server_handled_total", {}), timeout=10
        ), "the NOT_FOUND Lookup was never counted"

        text = scrape(d)  # the client's session is still open
        stats = quiet_stats(d)
        scraped = Scrape(text)
        assert_tiers_match(scraped, stats)
        ram = {"tier": "ram", "kind": "ram"}
        assert scraped.value("kvstored_tier_evictions_total", **ram) == 4
        assert scraped.value("kvstored_tier_hits_total", **ram) > 0
        assert scraped.value("kvstored_tier_misses_total", **ram) > 0

        assert scraped.value("kvstored_sessions") == stats.sessions == 1
        assert scraped.value("kvstored_leases") == stats.leases == 0
        assert scraped.value("kvstored_reservations") == stats.reservations == 0
        assert scraped.value("kvstored_namespaces") == stats.namespaces == 1
        assert scraped.value("kvstored_build_info", version=stats.version) == 1
        assert (
            scraped.value(
                "kvstored_namespace_info",
                namespace=ns.namespace_id,
                model="metrics-ram",
                dtype="uint8",
                chunk_bytes=str(MIB),
            )
            == 1
        )

    kv_service = "kvstored.v1.KVStore"
    handled = "kvstored_grpc_server_handled_total"
    assert scraped.value(handled, service=kv_service, method="Reserve", code="OK") == 2
    assert scraped.value(handled, service=kv_service, method="Commit", code="OK") == 2
    assert scraped.value(handled, service=kv_service, method="Acquire", code="OK") == 1
    assert scraped.value(handled, service=kv_service, method="Delete", code="OK") == 1
    assert scraped.value(handled, service=kv_service, method="Lookup", code="OK") == 1
    assert scraped.value(handled, service=kv_service, method="Lookup", code="NOT_FOUND") == 1
    assert scraped.value(handled, service=kv_service, method="RegisterRegion", code="OK") == 0  # pre-created
    for labels, count in scraped.series(handled).items():
        if dict(labels)["method"] not in ("WatchEvents", "Snapshot"):  # server streams are not timed
            assert scraped.value("kvstored_grpc_server_handling_seconds_count", **dict(labels)) == count
    assert_histograms_consistent(scraped, "kvstored_grpc_server_handling_seconds")
    assert scraped.value("process_resident_memory_bytes") > 0

    run_promtool("check", "metrics", stdin=text)


def test_metrics_port_taken_refuses_the_start_and_off_serves_without(daemon_factory):
    first = daemon_factory(METRICS_PORT_0)
    port = METRICS_LINE.search(first.log)[1]
    second = daemon_factory(start=False)
    second.spawn(["--metrics-addr", f"127.0.0.1:{port}"])
    assert second.wait(timeout=60) == 1, second.log  # as a taken tcp_listen: systemd tries again
    assert f"cannot listen on 127.0.0.1:{port} (metrics_addr)" in second.log
    off = daemon_factory(["--metrics-addr", "off"])
    assert not METRICS_LINE.search(off.log)
    assert off.stats().tiers[0].name == "ram"  # serving
    assert Scrape(scrape(first)).value("kvstored_sessions") == 0


def test_idle_connections_to_the_metrics_port_hold_no_more_than_a_few_fds(daemon_factory):
    """The metrics port may be reachable by anyone (a pod network): a flood of idle connections
    must not take the file descriptors the daemon's clients need. It keeps at most
    MAX_CONNECTIONS open, closes one whose request does not come in time, and answers one
    request per connection; its unix sockets serve throughout."""
    from kvstored.observability.http import MAX_CONNECTIONS

    d = daemon_factory(METRICS_PORT_0)
    port = int(METRICS_LINE.search(d.log)[1])
    fds_before = len(os.listdir(f"/proc/{d.pid}/fd"))
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10 * MAX_CONNECTIONS)]
    try:
        assert wait_for(lambda: len(os.listdir(f"/proc/{d.pid}/fd")) <= fds_before + MAX_CONNECTIONS, timeout=10)
        assert d.stats().tiers[0].name == "ram"  # the unix socket serves
        # Those past the limit are closed at once, the others once their request is late.
        for sock in idle:
            sock.settimeout(30)
            assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()
    assert Scrape(scrape(d)).value("kvstored_sessions") == 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 405 ")
    request = urllib.request.Request(metrics_url(d), headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        assert b"kvstored_sessions" in gzip.decompress(resp.read())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(metrics_url(d).replace("/metrics", "/other"), timeout=10)
    assert err.value.code == 404


# -- with an fs tier ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fs_run():
    """One daemon with 4 MiB of RAM over a 256 MiB fs tier (and a peer tier with a directory), driven through
    write-back and promotion; yields its scrape and the quiet Stats around it."""
    from tests.support.daemon import Daemon
    from tests.support.ports import free_port

    root = short_tmpdir("kvfs")
    d = Daemon(cpu_bytes="4MiB")
    try:
        # ... and a peer tier whose one peer is down, its fleet directory unreachable: their series are in the scrape
        peer = (
            f"kind=peer,peers=127.0.0.1:{free_port()},transport=tcp,tcp_port=0,"
            f"directory=redis://127.0.0.1:{free_port()}"
        )
        d.start(
            METRICS_PORT_0
            + [
                "--tiers",
                f"kind=fs,root={root},bytes=256MiB",
                "--tiers",
                peer,
                "--tcp-listen",
                f"127.0.0.1:{free_port()}",
            ]
        )
        keys = make_keys("metrics-fs", 12)
        with d.client() as kv:
            ns = kv.register_namespace(model="metrics-fs", dtype="uint8", chunk_bytes=MIB)
            for i in range(0, len(keys), 2):
                kv.store(ns, keys[i : i + 2], payloads(keys[i : i + 2], MIB))
            quiet_stats(d)
            out = np.empty((2, MIB), np.uint8)
            assert kv.lookup(ns, keys).prefix_hits == len(keys)  # all in RAM or on disk
            assert kv.load(ns, keys[:2], out) == 2  # promoted back from the fs tier
            assert (out == payloads(keys[:2], MIB)).all()
            before = quiet_stats(d)
            text = scrape(d)
            after = quiet_stats(d)
        yield Scrape(text), before, after
        d.stop()
    finally:
        d.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def test_peer_metrics_have_a_bounded_peer_label(fs_run):
    scraped = fs_run[0]
    assert scraped.value("kvstored_peers", state="down") + scraped.value("kvstored_peers", state="connecting") == 1
    assert scraped.value("kvstored_peer_index_capacity") == 1_000_000
    assert scraped.value("kvstored_peer_leases") == scraped.value("kvstored_peer_reservations") == 0
    (series,) = scraped.series("kvstored_peer_up")
    assert dict(series).keys() == {"peer"} and dict(series)["peer"].startswith("127.0.0.1:")
    outcomes = {dict(k)["outcome"] for k in scraped.series("kvstored_peer_fetched_chunks_total")}
    assert outcomes == {"received", "missing", "corrupt", "failed", "timed_out", "breaker_open"}
    assert scraped.value("kvstored_tier_lookups_total", tier="peer", kind="peer") == 0  # fs above held it all


@pytest.mark.system_deps
def test_fs_tier_metrics_match_stats_and_pass_promtool(fs_run):
    scraped, before, after = fs_run
    assert before.tiers == after.tiers  # the scrape itself changed nothing
    assert_tiers_match(scraped, before)
    ram, fs = {"tier": "ram", "kind": "ram"}, {"tier": "fs", "kind": "fs"}
    assert scraped.value("kvstored_tier_writedowns_total", **ram) > 0
    assert scraped.value("kvstored_tier_promotions_total", **ram) >= 2
    assert scraped.value("kvstored_tier_written_bytes_total", **fs) >= MIB
    assert scraped.value("kvstored_tier_read_bytes_total", **fs) >= 2 * MIB
    assert scraped.value("kvstored_tier_hits_total", **fs) > 0
    assert scraped.value("kvstored_tier_capacity_bytes", **fs) == 256 * MIB
    for op in ("lookup", "read", "write", "remove"):  # exist from the start, observed by the chain
        assert scraped.value("kvstored_tier_operation_seconds_count", **fs, op=op) >= 0
    assert_histograms_consistent(scraped, "kvstored_tier_operation_seconds")
    run_promtool("check", "metrics", stdin=scraped.text)


@pytest.mark.system_deps
def test_packed_s3_live_fractions_in_stats_metrics_and_ctl(daemon_factory):
    """An operator sees how much of the packs is still live: Stats, /metrics and kvstoredctl agree."""
    chunk = 256 << 10
    record = chunkfile.HEADER_BYTES + chunk
    with MotoServer() as endpoint:
        tier = (
            f"kind=s3,bucket=kv-metrics,endpoint_url={endpoint.url},access_key={endpoint.access_key},"
            f"secret_key={endpoint.secret_key},region=us-east-1,pack_bytes=1MiB,pack_age_s=0.5,pack_poll_s=0"
        )
        d = daemon_factory([*METRICS_PORT_0, "--write-policy", "write-through", "--tiers", tier], cpu_bytes="8MiB")
        keys = make_keys("metrics-packs", 12)
        with d.client() as kv:
            ns = kv.register_namespace(model="metrics-packs", dtype="uint8", chunk_bytes=chunk)
            assert kv.store(ns, keys, payloads(keys, chunk)).stored == 12

            def s3() -> pb.TierStats:
                return next(t for t in d.stats().tiers if t.name == "s3")

            # 1 MiB packs hold three records: four packs, all live
            assert wait_for(lambda: s3().packs_written == 4, 30), s3()
            full = s3()
            assert full.packs == 4 and list(full.packs_by_live_quarter) == [0, 0, 0, 4]
            assert full.packed_live_bytes == 12 * record and full.packed_bytes > 12 * record
            assert kv.delete(ns, keys[:5]) == 5
        # five records dead: a pack that lost all of its is deleted, the others are part live
        after = s3()
        assert after.packed_live_bytes == 7 * record
        assert sum(after.packs_by_live_quarter) == after.packs <= 4 and after.packs_by_live_quarter[3] < 4
        scraped = Scrape(scrape(d))
        stats = quiet_stats(d)
        assert_tiers_match(scraped, stats)
        run_promtool("check", "metrics", stdin=scraped.text)
        # the dashboard's Packed S3 row: every pack family, each name and label in this scrape
        problems = unscraped("dashboard", pack_exprs(), scraped)
        assert not problems, "\n".join(problems)
        on_row = {name for e in pack_exprs() for name, _ in METRIC_NAME.findall(e)}
        assert on_row == {n for n in scraped.samples if n.startswith("kvstored_tier_pack")}, on_row
        status = subprocess.run(
            [sys.executable, "-m", "kvstored.ctl", "--socket", str(d.socket), "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
        live = 100 * after.packed_live_bytes / after.packed_bytes
        line = next(ln for ln in status.stdout.splitlines() if ln.startswith("s3 packs:"))
        assert f"s3 packs: {after.packs} (" in line and f"{live:.1f}% live" in line, status.stdout
        assert " / ".join(map(str, after.packs_by_live_quarter)) in line


def test_refused_deletes_are_not_backpressure_drops(daemon_factory, tmp_path):
    """drops{reason="backpressure"} counts refused write-downs (copies lost); a delete the queue
    refuses runs directly, so it is not one."""
    fs_tier = f"kind=fs,root={tmp_path},bytes=64MiB,concurrency=1,max_backlog=2"
    d = daemon_factory(METRICS_PORT_0 + ["--tiers", fs_tier, "--write-policy", "write-through"], cpu_bytes="16MiB")
    keys = make_keys("metrics-refused", 8)
    with d.client() as kv:
        ns = kv.register_namespace(model="metrics-refused", dtype="uint8", chunk_bytes=MIB)
        assert kv.store(ns, keys, payloads(keys, MIB)).stored == 8  # 8 write-downs at once, 2 queued
        refused_writes = _tier(quiet_stats(d), "fs").dropped_backpressure
        assert refused_writes > 0
        assert kv.delete(ns, keys) == 8  # 8 removals at once from the fs tier, 2 queued
        stats = quiet_stats(d)
        scraped = Scrape(scrape(d))
    assert _tier(stats, "fs").dropped_backpressure == refused_writes
    assert scraped.value("kvstored_tier_drops_total", tier="fs", kind="fs", reason="backpressure") == refused_writes


def _tier(stats: pb.StatsResponse, name: str) -> pb.TierStats:
    return next(t for t in stats.tiers if t.name == name)


# -- dashboard, rules, scrape config --------------------------------------------------------------

METRIC_NAME = re.compile(r"\b((?:kvstored|process)_[a-z0-9_]+)\b(\{[^}]*\})?")
LABEL_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def dashboard_exprs() -> list[str]:
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query", "definition") and isinstance(value, str):
                    exprs.append(value)
                elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                    exprs.append(value["query"])
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(DASHBOARD.read_text()))
    return exprs


def rules_exprs() -> list[str]:
    import yaml  # PyYAML comes with the dev extras (moto)

    doc = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


def unscraped(source: str, exprs: list[str], scraped: Scrape) -> list[str]:
    """The metric names and labels of `exprs` that a real scrape does not have."""
    problems = []
    for expr in exprs:
        for name, selector in METRIC_NAME.findall(expr):
            if name not in scraped.samples:
                problems.append(f"{source}: {name} is not in a real scrape ({expr!r})")
                continue
            for label in LABEL_MATCHER.findall(selector or ""):
                if label not in scraped.label_names[name] | PROMETHEUS_LABELS:
                    problems.append(f"{source}: {name} has no label {label!r} ({expr!r})")
    return problems


def pack_exprs() -> list[str]:
    """The Packed S3 row's queries (their bands exist only with a packed tier: checked against one)."""
    return [e for e in dashboard_exprs() if "kvstored_tier_pack" in e]


def test_dashboard_and_rules_only_use_scraped_names_and_labels(fs_run):
    scraped = fs_run[0]
    sources = {"dashboard": [e for e in dashboard_exprs() if e not in pack_exprs()], "rules": rules_exprs()}
    assert len(sources["dashboard"]) >= 15 and len(sources["rules"]) >= 5
    problems = [p for source, exprs in sources.items() for p in unscraped(source, exprs, scraped)]
    assert not problems, "\n".join(problems)
    assert any("kvstored_tier_operation_seconds_bucket" in e for e in sources["dashboard"])
    # the Directory row: every family of the fleet directory is on it
    directory = {name for e in sources["dashboard"] for name, _ in METRIC_NAME.findall(e) if "_directory_" in name}
    assert directory == {n for n in scraped.samples if n.startswith("kvstored_directory_")}, directory


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and dash["schemaVersion"] >= 30
    panels = [p for p in dash["panels"] if p.get("type") != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert "gridPos" in panel
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= variables


@pytest.mark.system_deps
def test_rules_and_scrape_config_pass_promtool():
    run_promtool("check", "rules", str(RULES))
    run_promtool("check", "config", str(SCRAPE_CONFIG))


@pytest.mark.system_deps
def test_ram_thrash_alert_fires_only_when_full_and_missing(tmp_path):
    """promtool unit test of the alert: RAM full and every lookup a miss -> fires; a full RAM
    tier that still hits, or an empty one that misses, does not."""

    def series(instance: str, hits: str, lookups: str, util: str) -> list[dict]:
        labels = f'job="kvstored",instance="{instance}",tier="ram",kind="ram"'
        return [
            {"series": f"kvstored_tier_hits_total{{{labels}}}", "values": hits},
            {"series": f"kvstored_tier_lookups_total{{{labels}}}", "values": lookups},
            {"series": f"kvstored_tier_utilization_ratio{{{labels}}}", "values": util},
        ]

    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": (
                    series("thrash:9464", "0+0x60", "0+600x60", "0.99x60")
                    + series("healthy:9464", "0+500x60", "0+600x60", "0.99x60")
                    + series("empty:9464", "0+0x60", "0+600x60", "0.10x60")
                ),
                "alert_rule_test": [
                    {
                        "eval_time": "50m",
                        "alertname": "KvstoredRamTierThrashing",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "instance": "thrash:9464", "job": "kvstored"},
                                "exp_annotations": {
                                    "summary": "kvstored RAM tier on thrash:9464 is full but almost never hits",
                                    "description": (
                                        "The RAM tier hit rate has been below 1% for 15 minutes while it is over 90% "
                                        "full: chunks are evicted before they are reused. Give it more memory "
                                        "(cpu_bytes), add a lower tier, or check that clients use stable keys."
                                    ),
                                },
                            }
                        ],
                    },
                    {"eval_time": "5m", "alertname": "KvstoredRamTierThrashing", "exp_alerts": []},
                ],
            }
        ],
    }
    test_file = tmp_path / "thrash_test.yml"
    test_file.write_text(json.dumps(tests))  # JSON is YAML
    run_promtool("test", "rules", str(test_file))


@pytest.mark.system_deps
def test_directory_alerts_fire_on_an_open_breaker_and_a_long_lag(tmp_path):
    """promtool unit test: a breaker open for 10 minutes fires KvstoredDirectoryUnreachable, one
    open for 2 does not; a lag of 120 s for 10 minutes fires KvstoredDirectoryLagging, 1 s does not."""

    def series(instance: str, name: str, values: str) -> dict:
        return {"series": f'kvstored_directory_{name}{{job="kvstored",instance="{instance}"}}', "values": values}

    import yaml

    rules = {r.get("alert"): r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}

    def fired(alert: str, instance: str, summary: str) -> list[dict]:
        labels = {"severity": "warning", "instance": instance, "job": "kvstored"}
        annotations = {"summary": summary, "description": rules[alert]["annotations"]["description"]}
        return [{"exp_labels": labels, "exp_annotations": annotations}]

    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    series("down:9464", "breaker_open", "1x20"),
                    series("blip:9464", "breaker_open", "0x8 1 1 0x10"),
                    series("behind:9464", "lag_seconds", "120x20"),
                    series("fine:9464", "lag_seconds", "1x20"),
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "12m",
                        "alertname": "KvstoredDirectoryUnreachable",
                        "exp_alerts": fired(
                            "KvstoredDirectoryUnreachable",
                            "down:9464",
                            "kvstored on down:9464 cannot reach its fleet directory",
                        ),
                    },
                    {
                        "eval_time": "12m",
                        "alertname": "KvstoredDirectoryLagging",
                        "exp_alerts": fired(
                            "KvstoredDirectoryLagging",
                            "behind:9464",
                            "kvstored on behind:9464 is 2m 0s behind in the fleet directory",
                        ),
                    },
                    {"eval_time": "3m", "alertname": "KvstoredDirectoryUnreachable", "exp_alerts": []},
                ],
            }
        ],
    }
    test_file = tmp_path / "directory_test.yml"
    test_file.write_text(json.dumps(tests))
    run_promtool("test", "rules", str(test_file))
