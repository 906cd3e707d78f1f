# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The client in vLLM's environment: installing it changes none of vLLM's pinned packages (torch
above all), the socket option has one name in both modes, and VLLM_PLUGINS gates the plugin."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from typing import cast

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvstored_client.vllm.direct import KvstoredOffloadingSpec
from kvstored_client.vllm.plugin import register
from tests.support.daemon import REPO_ROOT, clean_env
from tests.vllm.harness import Engine, offload_keys, offloading_config
from tests.vllm.test_tier import HIT, store_and_cascade

register()


def client_requirements() -> list[Requirement]:
    """Every requirement of the client package, extras included (from its pyproject)."""
    project = tomllib.loads((REPO_ROOT / "client" / "pyproject.toml").read_text())["project"]
    extras = [r for reqs in project.get("optional-dependencies", {}).values() for r in reqs]
    return [Requirement(r) for r in project["dependencies"] + extras]


def vllm_pins() -> dict[str, str]:
    """The packages vllm==0.33.0 pins to one version on this machine (no extra), by name."""
    env = default_environment()
    pins = {}
    for raw in importlib.metadata.requires("vllm") or ():
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({**cast(dict[str, str], env), "extra": ""}):
            continue
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[req.name.lower()] = exact[0]
    return pins


def test_installing_the_client_keeps_every_package_vllm_pins():
    pins = vllm_pins()
    assert pins.get("torch") == "2.14.0"  # what vLLM 0.33 wants, and a pin of ours would fight
    reqs = client_requirements()
    assert not [r for r in reqs if r.name.lower() == "torch"], "the client must leave torch to its environment"
    for req in reqs:
        pinned = pins.get(req.name.lower())
        if pinned is not None:
            assert req.specifier.contains(pinned, prereleases=True), f"{req} conflicts with vLLM's =={pinned}"


def test_the_test_setup_still_pins_torch_first():
    makefile = (REPO_ROOT / "Makefile").read_text()
    dev = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert "torch==2.13.0" in dev
    torch_line = next(i for i, line in enumerate(makefile.splitlines()) if "pip install" in line and "torch==" in line)
    dev_line = next(i for i, line in enumerate(makefile.splitlines()) if "pip install" in line and "[dev]" in line)
    assert torch_line < dev_line  # pinned torch first: an unpinned one pulls a multi-GB CUDA build


def test_kvstored_socket_names_the_socket_in_mode_1_too(vllm_daemon):
    keys = offload_keys("socket-name", 2)
    tier = {"type": "kvstored", "kvstored_socket": str(vllm_daemon.socket)}
    with Engine([tier]) as engine:
        assert engine.tier.config_info() == {"kvstored_socket": str(vllm_daemon.socket)}
        store_and_cascade(engine, keys)
    with Engine([{"type": "kvstored", "socket": str(vllm_daemon.socket)}]) as engine:  # the alias
        ctx = engine.request()
        assert engine.lookup(ctx, keys) == [HIT] * 2
        engine.finish(ctx)


def test_two_names_for_different_sockets_are_refused(vllm_daemon, tmp_path):
    tier = {"type": "kvstored", "kvstored_socket": str(vllm_daemon.socket), "socket": str(tmp_path / "other.sock")}
    with pytest.raises(ValueError, match="kvstored_socket=.* and socket=.* name different sockets"):
        Engine([tier])


def test_mode_2_takes_the_same_names(vllm_daemon):
    for name in ("kvstored_socket", "socket"):
        spec = OffloadingSpecFactory.create_spec(
            offloading_config({"spec_name": "KvstoredOffloadingSpec", name: str(vllm_daemon.socket)})
        )
        assert isinstance(spec, KvstoredOffloadingSpec) and spec.socket == str(vllm_daemon.socket)


# What vLLM does in each of its processes: load the general plugins, then resolve the tier type.
PLUGIN_PROBE = """
from vllm.plugins import load_general_plugins
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
load_general_plugins()
try:
    print(SecondaryTierFactory.get_tier_class({"type": "kvstored"}).__name__)
except ValueError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize(
    "allowed, outcome",
    [
        (None, "KvstoredTierManager"),
        ("kvstored", "KvstoredTierManager"),
        ("lora_filesystem_resolver", "refused: Unknown secondary tier type"),
    ],
)
def test_vllm_plugins_must_include_kvstored_when_set(allowed, outcome):
    env = clean_env()
    env.pop("VLLM_PLUGINS", None)
    if allowed is not None:
        env["VLLM_PLUGINS"] = allowed
    proc = subprocess.run(
        [sys.executable, "-c", PLUGIN_PROBE], capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(outcome), proc.stdout
