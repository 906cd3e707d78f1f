# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The layout shows the data flow (client -> gRPC service -> session broker -> tier chain -> tiers ->
chunks, shm, io; events and metrics beside them): a layer never imports one above it, and no
module imports itself back through others. Checked on the source, so a new module that reaches
upwards fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ABOVE_CHAIN = ("kvstored.server", "kvstored.cli", "kvstored.ctl", "kvstored.config", "kvstored.top")

# package -> packages it must not import (directly or by `from ... import`)
FORBIDDEN = {
    "kvstored/chain": ABOVE_CHAIN,
    # tiers/peer.py (the peer tier kind) and tiers/config.py may use kvstored.peer: it is below them
    "kvstored/tiers": (*ABOVE_CHAIN, "kvstored.chain", "kvstored.observability"),
    "kvstored/peer": (
        *ABOVE_CHAIN,
        "kvstored.chain",
        "kvstored.tiers",
        "kvstored.observability",
        "kvstored.directory",
    ),
    # the fleet directory sits beside the peer mesh: the peer tier uses both, neither the other
    "kvstored/directory": (
        *ABOVE_CHAIN,
        "kvstored.chain",
        "kvstored.tiers",
        "kvstored.peer",
        "kvstored.observability",
        "kvstored.shm",
    ),
    "kvstored/events": (*ABOVE_CHAIN, "kvstored.chain", "kvstored.tiers", "kvstored.peer", "kvstored.observability"),
    # metrics and Stats read what the chain fills in (observability/snapshot.py), never the chain
    "kvstored/observability": (*ABOVE_CHAIN, "kvstored.chain", "kvstored.tiers", "kvstored.peer"),
    "kvstored/chunks": (
        *ABOVE_CHAIN,
        "kvstored.chain",
        "kvstored.tiers",
        "kvstored.peer",
        "kvstored.events",
        "kvstored.observability",
        "kvstored.shm",
        "kvstored.io",
    ),
    "kvstored/shm": (
        *ABOVE_CHAIN,
        "kvstored.chain",
        "kvstored.tiers",
        "kvstored.peer",
        "kvstored.events",
        "kvstored.observability",
    ),
    "kvstored/io": (
        *ABOVE_CHAIN,
        "kvstored.chain",
        "kvstored.tiers",
        "kvstored.peer",
        "kvstored.events",
        "kvstored.observability",
    ),
    "client/kvstored_client": ("kvstored.",),  # the client ships without the daemon
}


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _within(name: str, package: str) -> bool:
    package = package.rstrip(".")
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_layer_imports_one_above_it(package):
    sources = [p for p in (REPO / package).rglob("*.py") if "_gen" not in p.parts]
    assert sources, f"no sources under {package}"
    wrong = sorted(
        {
            f"{p.relative_to(REPO)} imports {name}"
            for p in sources
            for name in imported_modules(p)
            if any(_within(name, bad) for bad in FORBIDDEN[package])
        }
    )
    assert not wrong, "\n".join(wrong)


# -- no import circle ----------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module loads: at module level, in classes, and under module-level
    if/try. Not inside functions (they run when called, after every module has loaded: how a
    factory loads a tier kind's libraries only when one is built) nor under `if TYPE_CHECKING:`
    (they never run)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    todo += child.body if isinstance(child, ast.ExceptHandler) else [child]
    return found


def import_graph() -> dict[str, set[str]]:
    """kvstored module -> the kvstored modules it imports at load time. `from pkg import name` is
    an edge to the submodule pkg.name when there is one, else to pkg."""
    sources = {_module_name(p): p for p in (REPO / "kvstored").rglob("*.py") if "_gen" not in p.parts}
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        edges = set()
        for node in _load_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in sources}
            elif node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    edges.add(target if target in sources else node.module)
        graph[module] = {e for e in edges if e in sources and e != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as the list of modules around it), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_circle_check_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "kvstored.chain.chain" in import_graph()["kvstored.chain.stats"]


# -- the chain's insides stay in the chain ---------------------------------------------------------


def _chain_insides_reached(path: Path) -> list[str]:
    """`<something named *chain*>.ram` / `.promoter` / `._private` (a reader leases through
    chain.leases; the chain's RAM tier and promoter are its own)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
        if "chain" in owner.lower() and (node.attr in ("ram", "promoter") or node.attr.startswith("_")):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_nothing_outside_the_chain_reaches_into_it():
    sources = [p for p in (REPO / "kvstored").rglob("*.py") if "chain" not in p.relative_to(REPO).parts[:2]]
    assert sources
    wrong = [hit for p in sources for hit in _chain_insides_reached(p)]
    assert not wrong, "\n".join(wrong)
