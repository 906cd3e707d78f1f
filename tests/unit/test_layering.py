"""The layout shows the data flow (client -> gRPC service -> session broker -> tier chain -> tiers ->
metrics/events): a layer never imports one above it. Checked on the source, so a new module that
reaches upwards fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# package -> packages it must not import (directly or by `from ... import`)
FORBIDDEN = {
    "kvstored/tiers": ("kvstored.server", "kvstored.cli", "kvstored.ctl"),
    "kvstored/observability": ("kvstored.server", "kvstored.cli", "kvstored.ctl"),
    "kvstored/shm": ("kvstored.server", "kvstored.tiers", "kvstored.observability"),
    "kvstored/io": ("kvstored.server", "kvstored.tiers", "kvstored.observability"),
    "kvstored/peer": ("kvstored.server", "kvstored.cli", "kvstored.ctl"),
    "client/kvstored_client": ("kvstored.",),  # the client ships without the daemon
}


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_layer_imports_one_above_it(package):
    sources = [p for p in (REPO / package).rglob("*.py") if "_gen" not in p.parts]
    assert sources, f"no sources under {package}"
    wrong = [
        f"{p.relative_to(REPO)} imports {name}"
        for p in sources
        for name in imported_modules(p)
        if any(name == bad.rstrip(".") or name.startswith(bad.rstrip(".") + ".") for bad in FORBIDDEN[package])
    ]
    assert not wrong, "\n".join(wrong)
