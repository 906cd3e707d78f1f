# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Access control: tenant namespaces are private to their sessions; the TCP listener's TLS rules."""

from __future__ import annotations

import os
import socket

import grpc
import numpy as np
import pytest

from kvstored_client import ops
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from kvstored_client._gen.kvstored.v1 import kvstored_pb2_grpc as pb_grpc
from tests.support.another_user import NOBODY, OTHER_GROUP, group_only_socket_dir, run_script
from tests.support.daemon import Daemon
from tests.support.data import make_keys, payloads
from tests.support.tls import make_certs

CHUNK = 64 << 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tenant_namespace_is_invisible_to_other_sessions(daemon, ns_name):
    keys = make_keys("tenant", 4)
    data = payloads(keys, CHUNK)
    with daemon.client() as owner, daemon.client() as other:
        ns = owner.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"acme")
        assert owner.store(ns, keys, data).stored == 4
        assert owner.lookup(ns, keys).prefix_hits == 4

        # `other` knows the namespace id but never registered it in its session.
        assert other.lookup(ns, keys).prefix_hits == 0
        out = np.zeros_like(data)
        assert other._run(lambda s: ops.load(s, ns, keys, out), fallback=-1, session=True) == 0
        assert not out.any()
        poisoned = other._run(lambda s: ops.store(s, ns, make_keys("poison", 1), data[:1]), None, session=True)
        assert poisoned.stored == 0 and poisoned.dropped == 1
        assert other.delete(ns, keys) == 0

        # Exactly a miss, also without any session at all (grpcurl-style).
        with daemon.channel() as channel:
            stub = pb_grpc.KVStoreStub(channel)
            resp = stub.Lookup(pb.LookupRequest(namespace_id=ns.namespace_id, keys=keys), timeout=10)
            assert resp.prefix_hits == 0 and list(resp.tiers) == [pb.TIER_KIND_UNSPECIFIED] * 4
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterNamespace(pb.RegisterNamespaceRequest(spec=ns.spec.to_proto()), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "session" in err.value.details()

        # The owner's data is untouched, and a tenant who registers the same salt shares it.
        assert owner.load(ns, keys, out) == 4 and np.array_equal(out, data)
        same_tenant = other.register_namespace(ns.spec)
        assert same_tenant.namespace_id == ns.namespace_id
        assert other.lookup(same_tenant, keys).prefix_hits == 4


def test_different_salts_give_different_namespaces(daemon, ns_name):
    with daemon.client() as kv:
        a = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"a")
        b = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"b")
        plain = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK)
        assert len({a.namespace_id, b.namespace_id, plain.namespace_id}) == 3
        keys = make_keys("salt", 2)
        kv.store(a, keys, payloads(keys, CHUNK))
        assert kv.lookup(b, keys).prefix_hits == 0
        assert kv.lookup(plain, keys).prefix_hits == 0


def test_tenant_client_recovers_after_daemon_restart(daemon, ns_name):
    keys = make_keys("tenant-restart", 2)
    with daemon.client() as kv:
        ns = kv.register_namespace(model=ns_name, dtype="u8", chunk_bytes=CHUNK, tenant_salt=b"acme")
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == 2
        daemon.stop()
        daemon.start()
        # The new daemon knows nothing: the client opens a new session, registers again, stores.
        assert kv.lookup(ns, keys).prefix_hits == 0
        assert kv.store(ns, keys, payloads(keys, CHUNK)).stored == 2
        assert kv.lookup(ns, keys).prefix_hits == 2


def test_tcp_beyond_loopback_requires_tls(tmp_path):
    d = Daemon()
    try:
        proc = d.spawn(["--tcp-listen", "0.0.0.0:0", "--metrics-addr", "off"])
        assert proc.wait(30) == 2
        assert "beyond loopback" in d.log and "tls_cert_file" in d.log
    finally:
        d.cleanup()


def _stats_over(target: str, creds: grpc.ChannelCredentials | None):
    channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
    with channel:
        return pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=5)


def test_tcp_listener_serves_tls_and_mutual_tls(daemon_factory, tmp_path):
    certs = make_certs(tmp_path)
    ca = certs.ca.read_bytes()
    client_pair = (certs.client_key.read_bytes(), certs.client_cert.read_bytes())

    port = _free_port()
    daemon_factory(
        [
            "--tcp-listen",
            f"127.0.0.1:{port}",
            "--tls-cert-file",
            str(certs.server_cert),
            "--tls-key-file",
            str(certs.server_key),
        ]
    )
    target = f"127.0.0.1:{port}"
    assert _stats_over(target, grpc.ssl_channel_credentials(root_certificates=ca)).version
    with pytest.raises(grpc.RpcError):
        _stats_over(target, None)  # plaintext against a TLS port fails

    mport = _free_port()
    daemon_factory(
        [
            "--tcp-listen",
            f"127.0.0.1:{mport}",
            "--tls-cert-file",
            str(certs.server_cert),
            "--tls-key-file",
            str(certs.server_key),
            "--tls-client-ca-file",
            str(certs.ca),
        ]
    )
    mtarget = f"127.0.0.1:{mport}"
    with pytest.raises(grpc.RpcError):  # no client certificate: refused
        _stats_over(mtarget, grpc.ssl_channel_credentials(root_certificates=ca))
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=client_pair[0], certificate_chain=client_pair[1]
    )
    assert _stats_over(mtarget, creds).version


def test_tcp_loopback_plaintext_allowed(daemon_factory):
    port = _free_port()
    daemon_factory(["--tcp-listen", f"127.0.0.1:{port}"])
    assert _stats_over(f"127.0.0.1:{port}", None).version


def test_region_paths_outside_region_dirs_are_refused(daemon, tmp_path):
    from tests.support.rpc import RawConn

    outside = tmp_path / "secret"
    outside.write_bytes(b"x" * 65536)
    link = __import__("pathlib").Path("/dev/shm") / f"kvlink-{os.getpid()}"
    link.symlink_to(outside)
    conn = RawConn(daemon.socket)
    try:
        for path in (outside, link):
            with pytest.raises(grpc.RpcError) as err:
                conn.call("RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=str(path)))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "outside the allowed directories" in err.value.details()
        # the same file handed over as an fd (the client proves it can open it) is fine
        with daemon.client() as kv:
            region = kv.register_region(outside)
            assert region.size == 65536 and region.region_id > 0
    finally:
        link.unlink()
        conn.session.close()


# -- a region named by path, as another user ---------------------------------------------------------


# Runs as root long enough to import everything, then becomes nobody with the given groups and
# names each path in a RegisterRegion (the daemon, root, could open every one of them).
REGISTER_AS_NOBODY = """
import json, os, sys
import grpc
from kvstored_client._gen.kvstored.v1 import kvstored_pb2 as pb
from tests.support.rpc import RawConn
sock, groups, paths = sys.argv[1], [int(g) for g in sys.argv[2].split(",") if g], sys.argv[3:]
os.setgroups(groups)
os.setgid(65534)
os.setuid(65534)
conn = RawConn(sock)
answers = []
for path in paths:
    try:
        size = conn.call("RegisterRegion", pb.RegisterRegionRequest(session_id=conn.session_id, path=path)).size
        answers.append(["OK", str(size)])
    except grpc.RpcError as e:
        answers.append([e.code().name, e.details()])
conn.session.close()
print(json.dumps(answers))
"""


@pytest.mark.root
def test_a_region_path_is_registered_only_for_the_files_owner(daemon_factory):
    """The daemon opens a region named by path with its own rights: a client may name only a file
    it owns, whatever the mode grants its group or others (the file may sit in a directory the
    client could not enter, or carry an ACL); anything else it opens itself and passes as an fd."""
    d = daemon_factory(socket=group_only_socket_dir("kvregion") / "kv.sock")  # nobody reaches it through the group
    files = {
        "root 0600": (0, 0, 0o600),
        "root 0666": (0, 0, 0o666),
        "nobody 0600": (NOBODY, NOBODY, 0o600),
        "group rw": (0, OTHER_GROUP, 0o660),
    }
    paths = {}
    try:
        for label, (uid, gid, mode) in files.items():
            path = paths[label] = f"/dev/shm/kvregion-{os.getpid()}-{label.replace(' ', '-')}"
            with open(path, "wb") as f:
                f.write(b"secret" * 10923)
            os.chown(path, uid, gid)
            os.chmod(path, mode)
        answers = dict(zip(paths, run_script(REGISTER_AS_NOBODY, str(d.socket), str(OTHER_GROUP), *paths.values())))
        assert {label: code for label, (code, _) in answers.items()} == {
            "root 0600": "PERMISSION_DENIED",
            "root 0666": "PERMISSION_DENIED",
            "nobody 0600": "OK",
            "group rw": "PERMISSION_DENIED",
        }
        said = answers["root 0666"][1]
        assert f"is not owned by the session's user (uid {NOBODY})" in said and "AttachRegion" in said
    finally:
        for path in paths.values():
            os.unlink(path)
