"""The README as a user reads it: every ```python and ```sh/```bash block runs, in order, against a
real daemon set up like `make run` (RAM + an fs tier, on a temp socket instead of
var/kvstored.sock), and then the whole README runs a second time against the same daemon: a
snippet must be honest on a rerun too.

Blocks are discovered, not listed: a new block either runs here or is named in NOT_RUN (a string
only it contains, and why it cannot run here); NOT_RUN stays small, and its blocks get the
static checks below instead (the files they name exist, their JSON parses).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstored.ctl import build_parser
from tests.support.daemon import REPO_ROOT, Daemon, clean_env, short_tmpdir, stop_all

README = REPO_ROOT / "README.md"
RUN_LANGS = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
BLOCK_TIMEOUT_S = 180

# A string only that block contains -> why it cannot run here (and what checks it instead).
NOT_RUN = {
    "make test    #": "make's entry points themselves: `make run` serves until stopped (test_make.py checks the "
                      "command it runs), `make test` is this suite",
    '"kv_connector"': "vllm serve: vLLM on a GPU with a downloaded model; tests/vllm drive the same tier and spec "
                      "on CPU, and its --kv-transfer-config JSON is parsed below",
    "useradd": "installs a system service as root on the real machine; test_systemd.py verifies the unit and runs "
               "its ExecStart, test_deploy.py checks what the recipe installs",
    "docker run": "needs a container engine (none here); test_deploy.py lints the Containerfile and builds its "
                  "wheels, and runs a client under another uid/gid against a group-owned socket directory: what "
                  "the mount and the group mapping amount to",
    "kubectl apply": "needs a Kubernetes cluster; test_deploy.py validates the manifests against Kubernetes' schemas",
}

# What the snippets name that the test provides elsewhere.
SOCKET_IN_README = "var/kvstored.sock"
REGION_IN_README = "/dev/shm/my_region"


@dataclass(frozen=True)
class Block:
    lang: str  # as written after the fence
    code: str
    line: int  # of the opening fence
    heading: str

    @property
    def kind(self) -> str | None:
        """"python" or "sh" if the test runs blocks of this language."""
        return RUN_LANGS.get(self.lang.lower())

    @property
    def label(self) -> str:
        return f"README.md:{self.line} ({self.heading}, ```{self.lang})"

    def skip_reasons(self) -> list[str]:
        return [why for marker, why in NOT_RUN.items() if marker in self.code]


def readme_blocks(text: str) -> list[Block]:
    blocks, heading, fence = [], "top", None
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            if line.startswith("#") and not line.startswith("#!"):
                heading = line.lstrip("#").strip()
            elif line.startswith("```"):
                fence = (line[3:].strip().split(" ")[0], number, [])
        elif line.startswith("```"):
            lang, start, body = fence
            blocks.append(Block(lang, "\n".join(body) + "\n", start, heading))
            fence = None
        else:
            fence[2].append(line)
    assert fence is None, f"README.md:{fence[1]}: a code block is never closed"
    return blocks


BLOCKS = readme_blocks(README.read_text())
RUNNABLE = [b for b in BLOCKS if b.kind and not b.skip_reasons()]


def test_blocks_are_found_and_every_skip_names_one_block():
    assert len([b for b in BLOCKS if b.kind == "python"]) >= 2 and len([b for b in BLOCKS if b.kind == "sh"]) >= 3
    for marker in NOT_RUN:
        matching = [b.label for b in BLOCKS if marker in b.code]
        assert matching, f"NOT_RUN entry {marker!r} matches no README block any more: remove it"
    for block in BLOCKS:
        assert len(block.skip_reasons()) <= 1, f"{block.label} matches several NOT_RUN entries"
        if block.skip_reasons():
            assert block.kind, f"{block.label}: NOT_RUN lists a block that would not run anyway"
    assert len(NOT_RUN) <= 6, "NOT_RUN is for the few blocks that cannot run here"


@pytest.fixture(scope="module")
def readme_daemon():
    """Like `make run`: a RAM tier and an fs tier (small, on a temp socket)."""
    fs_root = short_tmpdir("kvreadme")
    d = Daemon(cpu_bytes="192MiB")
    try:
        d.start(["--tiers", f"kind=fs,root={fs_root},bytes=1GiB"])
        yield d
    finally:
        errors = stop_all([d])
        subprocess.run(["rm", "-rf", str(fs_root)], check=False)
        if errors:
            pytest.fail("daemon teardown failed:\n" + "\n".join(errors), pytrace=False)


def venv_dir() -> Path:
    """What `.venv` stands for in the snippets: the environment these tests run in."""
    prefix = Path(sys.prefix)
    assert (prefix / "bin" / "activate").exists(), f"the tests run outside a venv ({prefix}): `make test` makes one"
    return prefix


def localize(code: str, socket: Path, region: Path) -> str:
    code = code.replace(SOCKET_IN_README, str(socket)).replace(REGION_IN_README, str(region))
    return re.sub(r"(?<![\w/.-])\.venv/", f"{venv_dir()}/", code)


def run_block(block: Block, socket: Path, region: Path, workdir: Path) -> subprocess.CompletedProcess:
    code = localize(block.code, socket, region)
    script = workdir / ("snippet.py" if block.kind == "python" else "snippet.sh")
    script.write_text(code)
    argv = [sys.executable, str(script)] if block.kind == "python" else ["bash", "-eo", "pipefail", str(script)]
    return subprocess.run(argv, cwd=workdir, env=clean_env(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)


def test_every_snippet_runs_twice(readme_daemon, tmp_path):
    assert RUNNABLE, "no runnable block found in README.md"
    region = Path(f"/dev/shm/kvreadme-{uuid.uuid4().hex[:8]}")
    failures = []
    try:
        for round_ in (1, 2):  # the whole README once, then again on the same daemon
            for block in RUNNABLE:
                proc = run_block(block, readme_daemon.socket, region, tmp_path)
                if proc.returncode != 0:
                    failures.append(f"{block.label}, run {round_}: exit {proc.returncode}\n--- code\n"
                                    f"{block.code}--- stdout\n{proc.stdout[-3000:]}--- stderr\n{proc.stderr[-3000:]}")
            assert not failures, "\n\n".join(failures)
    finally:
        region.unlink(missing_ok=True)
    assert readme_daemon.running, readme_daemon.log


# -- what the blocks that cannot run here are checked for instead -----------------------------------

REPO_PATH = re.compile(r"(?<![\w/.-])((?:\./)?(?:deploy|client|proto|tests|bench|docs)/[\w./-]*\w)")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip_reasons()], ids=lambda b: f"line{b.line}")
def test_listed_blocks_name_files_that_exist(block):
    named = REPO_PATH.findall(block.code)
    missing = [p for p in named if not (REPO_ROOT / p).exists()]
    assert not missing, f"{block.label} names files the repository lacks: {missing}"


def test_vllm_configs_are_json():
    configs = []
    for block in BLOCKS:
        if '"kv_connector"' in block.code:
            argv = shlex.split(block.code.replace("\\\n", " "))
            configs.append(json.loads(argv[argv.index("--kv-transfer-config") + 1]))
    assert {c["kv_connector_extra_config"]["spec_name"] for c in configs} == {
        "TieringOffloadingSpec", "KvstoredOffloadingSpec"}


def test_kvstoredctl_commands_exist():
    parser = build_parser()
    commands = next(a for a in parser._subparsers._group_actions).choices  # noqa: SLF001 - argparse has no API
    used = set()
    for block in BLOCKS:
        for line in block.code.splitlines():
            found = re.findall(r"(?:^|[\s(/])kvstoredctl\s+(?:--\S+\s+\S+\s+)*([a-z][\w-]*)", line)
            used.update(found)
    assert used, "no kvstoredctl command in the README"
    assert used <= set(commands), f"the README uses kvstoredctl commands that do not exist: {used - set(commands)}"


def test_every_exported_metric_is_documented(daemon_factory):
    """The README's Metrics section names every kvstored_* family a daemon exports (tier series
    may be written as `_suffix` after a full kvstored_tier_ name, as the list does)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.integration.test_metrics import METRICS_PORT_0, metrics_url

    text = README.read_text()
    section = text[text.index("### Metrics"):text.index("###", text.index("### Metrics") + 3)]
    documented = set(re.findall(r"`(kvstored_\w+|_\w+)", section))
    d = daemon_factory(METRICS_PORT_0)
    with d.client() as kv:
        kv.register_namespace(model="documented", dtype="u8", chunk_bytes=1 << 16)
        with urllib.request.urlopen(metrics_url(d), timeout=10) as resp:
            families = list(text_string_to_metric_families(resp.read().decode()))
    suffix = {"counter": "_total", "info": "_info"}
    missing = []
    for family in families:
        if not family.name.startswith("kvstored_"):
            continue
        name = family.name + suffix.get(family.type, "")
        short = "_" + name.removeprefix("kvstored_tier_") if name.startswith("kvstored_tier_") else None
        if name not in documented and family.name not in documented and short not in documented:
            missing.append(name)
    assert not missing, f"exported but not in the README's Metrics section: {missing}"
