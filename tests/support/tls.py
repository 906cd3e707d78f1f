# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Throwaway certificates for TLS tests: a CA, a server certificate for 127.0.0.1 and a client
certificate, made with the openssl command-line tool."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(directory: Path, ips: tuple[str, ...] = ("127.0.0.1",)) -> Certs:
    """A CA, and a server and a client certificate it signed, both valid for `ips` and localhost
    (a cluster's nodes may share one: it serves their listeners and identifies them as clients)."""
    d = directory
    _run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=kvstored-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    (d / "san.cnf").write_text("subjectAltName=" + ",".join([*(f"IP:{ip}" for ip in ips), "DNS:localhost"]) + "\n")
    for name, cn in (("server", "127.0.0.1"), ("client", "kvstored-test-client")):
        _run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={cn}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        _run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "san.cnf",
            "-out",
            f"{name}.pem",
            cwd=d,
        )
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")
