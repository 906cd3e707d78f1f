# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Generates the gRPC/protobuf modules from ../proto when the package is built (they are not in
git), so `pip install ./client` works from a plain checkout, and builds the optional copy helper
(kvstored_client/_ntcopy.c); everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent / "proto"
GENERATED = HERE / "kvstored_client" / "_gen" / "kvstored" / "v1" / "kvstored_pb2.py"


def generate() -> None:
    """Generate from ../proto when it is there (a checkout); an sdist carries the output instead."""
    protos = sorted(PROTO_ROOT.glob("kvstored/v1/*.proto"))
    if not protos:
        if not GENERATED.exists():
            raise SystemExit(f"kvstored-client: no generated protobuf code and no .proto files under {PROTO_ROOT}")
        return
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit(
            "kvstored-client: building from a checkout needs grpcio-tools (pip install grpcio-tools)"
        ) from None

    args = [
        "protoc",
        f"-Ikvstored_client/_gen={PROTO_ROOT}",
        f"--python_out={HERE}",
        f"--pyi_out={HERE}",
        f"--grpc_python_out={HERE}",
    ]
    args += [f"kvstored_client/_gen/{p.relative_to(PROTO_ROOT)}" for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("kvstored-client: protoc failed on " + ", ".join(map(str, protos)))


class BuildWithProtos(build_py):
    def run(self) -> None:
        generate()
        super().run()


class SdistWithProtos(sdist):
    def run(self) -> None:
        generate()  # before the file list is made: the sdist carries the generated modules
        super().run()


# The C helpers are optional: without a C compiler the client copies with numpy.
setup(
    cmdclass={"build_py": BuildWithProtos, "sdist": SdistWithProtos},
    ext_modules=[
        Extension("kvstored_client._ntcopy", ["kvstored_client/_ntcopy.c"], optional=True),
        # The shared-memory key index (lookups of RAM hits without a round trip): optional too,
        # without it lookups ask the daemon.
        Extension("kvstored_client._keyindex", ["kvstored_client/_keyindex.c"], optional=True),
    ],
)
