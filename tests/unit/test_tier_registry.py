# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The tier kinds' registry: config entries, lazy imports, what a reload may change."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from kvstored.chunks.ids import TierKind
from kvstored.config import load_config
from kvstored.tiers.base import AdmissionPolicy, TierCapabilities
from kvstored.tiers.config import FsTierConfig, S3TierConfig
from kvstored.tiers.registry import KINDS, TierKindSpec, admission_changes, spec_of

SECOND = AdmissionPolicy.SECOND_EVICTION


def test_every_option_that_is_not_a_string_has_a_parser():
    """Else `coalesce_events=false` in --tiers would reach the tier as the string "false"."""
    from kvstored.tiers.registry import COMMON_PARSERS

    for spec in KINDS.values():
        hints = typing.get_type_hints(spec.config)
        unparsed = [
            f.name
            for f in dataclasses.fields(spec.config)
            if hints[f.name] not in (str, str | None) and f.name not in {**COMMON_PARSERS, **spec.parsers}
        ]
        assert unparsed == [], f"{spec.label}: {unparsed}"
    doc = {"tcp_listen": "127.0.0.1:7070", "tiers": ["kind=peer,peers=10.0.0.2:7070,coalesce_events=false"]}
    cfg = load_config(doc, {}).tiers[0]
    assert cfg.coalesce_events is False


def test_each_kind_is_found_by_its_label_and_by_its_config():
    assert set(KINDS) == {"fs", "s3", "peer"}
    for label, spec in KINDS.items():
        assert spec.label == label
        fields = {f.name for f in dataclasses.fields(spec.config)}
        assert {"name", "concurrency", "max_backlog"} <= fields
    fs, s3 = load_config({"tiers": ["kind=fs,root=/kv,bytes=1GiB", "kind=s3,bucket=kv"]}, {}).tiers
    assert spec_of(fs) is KINDS["fs"] and spec_of(fs).kind is TierKind.FS
    assert spec_of(s3) is KINDS["s3"] and spec_of(s3).kind is TierKind.S3
    with pytest.raises(TypeError, match="no tier kind"):
        spec_of(object())


def test_an_entry_naming_options_its_config_lacks_is_refused_at_once():
    with pytest.raises(TypeError, match="io_thread"):
        TierKindSpec(
            label="x",
            kind=TierKind.PEER,
            config=S3TierConfig,
            build=lambda cfg: None,
            minimums={"io_thread": 1},
        )
    with pytest.raises(TypeError, match="admission"):

        @dataclasses.dataclass(frozen=True)
        class NoAdmission:
            name: str = "x"
            concurrency: int = 1
            max_backlog: int = 1

        TierKindSpec(
            label="x",
            kind=TierKind.PEER,
            config=NoAdmission,
            build=lambda cfg: None,
            capabilities=TierCapabilities(admission=True),
        )


def test_configuring_an_s3_tier_does_not_import_its_libraries():
    """aiobotocore (and the tier modules) load only when a tier of that kind is built."""
    code = (
        "import sys\n"
        "from kvstored.config import load_config\n"
        "import kvstored.server.daemon\n"
        "cfg = load_config({'tiers': ['kind=s3,bucket=kv', 'kind=fs,root=/kv,bytes=1GiB']}, {})\n"
        "assert len(cfg.tiers) == 2\n"
        "loaded = [m for m in ('aiobotocore', 'kvstored.tiers.s3', 'kvstored.tiers.fs.tier') if m in sys.modules]\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_reload_may_change_the_admission_of_every_kind_that_has_one():
    fs = FsTierConfig(Path("/kv"), 1 << 30)
    s3 = S3TierConfig("kv")
    old = (fs, s3)
    assert admission_changes(old, old) == {}
    both = (dataclasses.replace(fs, admission=SECOND), dataclasses.replace(s3, admission=SECOND))
    assert admission_changes(old, both) == {0: SECOND, 1: SECOND}
    assert admission_changes(both, old) == {0: AdmissionPolicy.ALWAYS, 1: AdmissionPolicy.ALWAYS}
    assert admission_changes(old, (fs, dataclasses.replace(s3, admission=SECOND))) == {1: SECOND}
    # anything else needs a restart
    assert admission_changes(old, (fs, dataclasses.replace(s3, admission=SECOND, prefix="p/"))) is None
    assert admission_changes(old, (fs,)) is None
    assert admission_changes(old, (s3, fs)) is None
