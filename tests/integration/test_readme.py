# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The README and docs/*.md as a user reads them: every ```python and ```sh/```bash block runs, in
order (README.md first, then docs/ by name), against a real daemon set up like `make run` (RAM +
an fs tier, on a temp socket instead of var/kvstored.sock), and then all of them run a second time
against the same daemon: a snippet must be honest on a rerun too.

Blocks are discovered, not listed: a new block either runs here or is named in NOT_RUN (a string
only it contains, and why it cannot run here); NOT_RUN stays small, and its blocks get the static
checks below instead (the files they name exist, their JSON parses). Besides: every relative link
and anchor between these files resolves, every TOML block parses, the start-up log the README
quotes is what a daemon logs, and every kvstored_* metric a daemon exports is documented.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.daemon import REPO_ROOT, Daemon, clean_env, short_tmpdir, stop_all

README = REPO_ROOT / "README.md"
DOCS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
METRICS_DOC = REPO_ROOT / "docs" / "operations.md"
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
    "make test PYTEST_ARGS": "runs parts of this suite, of which this test is one",
}

# What the snippets name that the test provides elsewhere.
SOCKET_IN_DOCS = "var/kvstored.sock"
REGION_IN_DOCS = "/dev/shm/my_region"


@dataclass(frozen=True)
class Block:
    doc: Path
    lang: str  # as written after the fence
    code: str
    line: int  # of the opening fence
    heading: str

    @property
    def kind(self) -> str | None:
        """ "python" or "sh" if the test runs blocks of this language."""
        return RUN_LANGS.get(self.lang.lower())

    @property
    def label(self) -> str:
        return f"{self.doc.relative_to(REPO_ROOT)}:{self.line} ({self.heading}, ```{self.lang})"

    def skip_reasons(self) -> list[str]:
        return [why for marker, why in NOT_RUN.items() if marker in self.code]


@dataclass(frozen=True)
class Heading:
    line: int
    text: str


def parse_doc(doc: Path) -> tuple[list[Block], list[Heading], list[tuple[int, str]]]:
    """(code blocks, headings, prose lines with their numbers) of one markdown file."""
    blocks, headings, prose = [], [], []
    heading = "top"
    fence: tuple[str, int, list[str]] | None = None
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if fence is None:
            if line.startswith("```"):
                fence = (line[3:].strip().split(" ")[0], number, [])
                continue
            if line.startswith("#") and not line.startswith("#!"):
                heading = line.lstrip("#").strip()
                headings.append(Heading(number, heading))
            prose.append((number, line))
        elif line.startswith("```"):
            lang, start, body = fence
            blocks.append(Block(doc, lang, "\n".join(body) + "\n", start, heading))
            fence = None
        else:
            fence[2].append(line)
    assert fence is None, f"{doc.relative_to(REPO_ROOT)}:{fence[1]}: a code block is never closed"
    return blocks, headings, prose


PARSED = {doc: parse_doc(doc) for doc in DOCS}
BLOCKS = [block for doc in DOCS for block in PARSED[doc][0]]
RUNNABLE = [b for b in BLOCKS if b.kind and not b.skip_reasons()]


def test_blocks_are_found_and_every_skip_names_one_block():
    assert len(DOCS) >= 8, f"docs/ lost its pages: {DOCS}"
    assert len([b for b in BLOCKS if b.kind == "python"]) >= 2 and len([b for b in BLOCKS if b.kind == "sh"]) >= 3
    for marker in NOT_RUN:
        matching = [b.label for b in BLOCKS if marker in b.code]
        assert matching, f"NOT_RUN entry {marker!r} matches no block any more: remove it"
    for block in BLOCKS:
        assert len(block.skip_reasons()) <= 1, f"{block.label} matches several NOT_RUN entries"
        if block.skip_reasons():
            assert block.kind, f"{block.label}: NOT_RUN lists a block that would not run anyway"
    assert len(NOT_RUN) <= 6, "NOT_RUN is for the few blocks that cannot run here"


def test_readme_stays_short():
    """The README is the first ten minutes; the rest lives in docs/."""
    assert len(README.read_text().splitlines()) <= 300


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
    code = code.replace(SOCKET_IN_DOCS, str(socket)).replace(REGION_IN_DOCS, str(region))
    return re.sub(r"(?<![\w/.-])\.venv/", f"{venv_dir()}/", code)


def run_block(block: Block, socket: Path, region: Path, workdir: Path) -> subprocess.CompletedProcess:
    code = localize(block.code, socket, region)
    script = workdir / ("snippet.py" if block.kind == "python" else "snippet.sh")
    script.write_text(code)
    argv = [sys.executable, str(script)] if block.kind == "python" else ["bash", "-eo", "pipefail", str(script)]
    return subprocess.run(
        argv,
        cwd=workdir,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def test_every_snippet_runs_twice(readme_daemon, tmp_path):
    assert RUNNABLE, "no runnable block found in README.md or docs/"
    assert {b.doc for b in RUNNABLE} > {README}, "docs/ has runnable blocks too"
    region = Path(f"/dev/shm/kvreadme-{uuid.uuid4().hex[:8]}")
    failures = []
    try:
        for round_ in (1, 2):  # every document once, then again on the same daemon
            for block in RUNNABLE:
                proc = run_block(block, readme_daemon.socket, region, tmp_path)
                if proc.returncode == 0 and REGION_IN_DOCS in block.code and region.exists():
                    failures.append(f"{block.label}, run {round_}: leaves its region file in /dev/shm")
                if proc.returncode != 0:
                    failures.append(
                        f"{block.label}, run {round_}: exit {proc.returncode}\n--- code\n"
                        f"{block.code}--- stdout\n{proc.stdout[-3000:]}--- stderr\n{proc.stderr[-3000:]}"
                    )
            assert not failures, "\n\n".join(failures)
    finally:
        region.unlink(missing_ok=True)
    assert readme_daemon.running, readme_daemon.log


# -- what the blocks that cannot run here are checked for instead -----------------------------------

REPO_PATH = re.compile(r"(?<![\w/.-])((?:\./)?(?:deploy|client|proto|tests|bench|docs)/[\w./-]*\w)")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.skip_reasons()], ids=lambda b: f"{b.doc.stem}-line{b.line}")
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
        "TieringOffloadingSpec",
        "KvstoredOffloadingSpec",
    }


def test_toml_blocks_parse():
    tomls = [b for b in BLOCKS if b.lang.lower() == "toml"]
    assert tomls, "no TOML example in the docs"
    for block in tomls:
        try:
            tomllib.loads(block.code)
        except tomllib.TOMLDecodeError as exc:
            pytest.fail(f"{block.label}: {exc}")


def test_kvstoredctl_commands_exist():
    used = set()
    for block in BLOCKS:
        for line in block.code.splitlines():
            used.update(re.findall(r"(?:^|[\s(/$])kvstoredctl\s+(?:--\S+\s+\S+\s+)*([a-z][\w-]*)", line))
    assert used, "no kvstoredctl command in the docs"
    kvstoredctl = Path(sys.executable).parent / "kvstoredctl"
    unknown = []
    for command in sorted(used):
        proc = subprocess.run(
            [str(kvstoredctl), command, "--help"], capture_output=True, text=True, timeout=60, env=clean_env()
        )
        if proc.returncode != 0:
            unknown.append(f"{command}: {proc.stderr.strip()[-300:]}")
    assert not unknown, "the docs use kvstoredctl commands that do not exist:\n" + "\n".join(unknown)


# -- links between the documents -----------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    for heading in (PARSED[doc] if doc in PARSED else parse_doc(doc))[1]:
        base, count = slug(heading.text), 0
        while (anchor := base if count == 0 else f"{base}-{count}") in found:
            count += 1
        found.add(anchor)
    return found


def links(doc: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in PARSED[doc][2]:
        prose = re.sub(r"`[^`]*`", "", line)  # a link inside inline code is an example, not a link
        found += [(number, target) for target in LINK.findall(prose)]
    return found


def test_every_link_and_anchor_resolves():
    broken, checked = [], 0
    for doc in DOCS:
        for number, target in links(doc):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            checked += 1
            path_part, _, anchor = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            where = f"{doc.relative_to(REPO_ROOT)}:{number}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {path_part}")
            elif anchor:
                if dest.suffix != ".md":
                    broken.append(f"{where}: an anchor into a file that is not markdown")
                elif anchor not in anchors(dest):
                    broken.append(f"{where}: {dest.name} has no heading with anchor #{anchor}")
    assert checked >= 40, f"only {checked} relative links found: is the link pattern still right?"
    assert not broken, "\n".join(broken)


def test_every_doc_is_reachable_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README) if not t.startswith("#")}
    assert set(DOCS[1:]) <= linked, f"docs the README's map does not name: {set(DOCS[1:]) - linked}"


# -- the start-up log the README quotes -----------------------------------------------------------------

# Lines a daemon logs only while something takes long: a test daemon's small pool is populated at once.
PERIODIC = ("populating the RAM tier: ",)
LOG_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+)\s+[\w.]+: (?P<message>.*)$")


def normalized(level: str, message: str) -> str:
    """Sizes, numbers and paths vary from start to start; the words do not."""
    message = re.sub(r"\d+(?:\.\d+)*\s?(?:[KMGT]i)?B/s\b", "RATE", message)
    message = re.sub(r"\d+(?:\.\d+)*\s?(?:[KMGT]i)?B\b", "SIZE", message)
    message = re.sub(r"[^\s()]*/[^\s()]*", "PATH", message)
    return f"{level} {re.sub(r'[0-9]+(?:[.][0-9]+)*', 'N', message)}"


def readme_startup_log() -> list[str]:
    block = next((b for b in PARSED[README][0] if b.lang == "text" and "serving on" in b.code), None)
    assert block, "the README quotes no start-up log (a ```text block with the 'serving on' line)"
    lines = []
    for line in block.code.splitlines():
        level, _, message = line.partition(" ")
        if not message.strip().startswith(PERIODIC):
            lines.append(normalized(level, message.strip()))
    return lines


def test_readme_startup_log_is_what_the_daemon_logs(daemon_factory):
    from tests.integration.test_metrics import METRICS_PORT_0

    fs_root = short_tmpdir("kvreadmelog")
    try:
        d = daemon_factory(METRICS_PORT_0 + ["--tiers", f"kind=fs,root={fs_root},bytes=1GiB"])
        deadline = time.monotonic() + 10  # health answers SERVING a moment before the line is written
        while "serving on" not in d.log and time.monotonic() < deadline:
            time.sleep(0.1)
        logged = [normalized(m["level"], m["message"]) for m in map(LOG_LINE.match, d.log.splitlines()) if m]
    finally:
        subprocess.run(["rm", "-rf", str(fs_root)], check=False)
    quoted = readme_startup_log()
    position = 0
    for line in quoted:  # in the README's order
        assert line in logged[position:], f"the README's start-up log has {line!r}; the daemon logged:\n{d.log}"
        position = logged.index(line, position) + 1


# -- metrics ----------------------------------------------------------------------------------------------


def test_every_exported_metric_is_documented(daemon_factory):
    """docs/operations.md's Metrics section names every kvstored_* family a daemon exports (tier series
    may be written as `_suffix` after a full kvstored_tier_ name, as the list does)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tests.integration.test_metrics import METRICS_PORT_0, metrics_url

    text = METRICS_DOC.read_text()
    start = text.index("\n## Metrics\n")
    section = text[start : text.index("\n## ", start + 3)]
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
    assert not missing, f"exported but not in {METRICS_DOC.name}'s Metrics section: {missing}"
