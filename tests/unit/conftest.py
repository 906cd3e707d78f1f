# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""S3 fixtures for the unit tests of the S3 tiers (one object per chunk, and packed): a moto
server per module, a fresh bucket per test, a raw aiobotocore client on it, and `s3_tiers`,
which starts tiers of a given class on the test's bucket and closes them at the end."""

from __future__ import annotations

import uuid

import pytest
from aiobotocore.session import get_session

from tests.support.s3 import MotoServer


@pytest.fixture(scope="module")
def moto():
    with MotoServer() as endpoint:
        yield endpoint


@pytest.fixture
def bucket() -> str:
    return f"kv-{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def raw(moto):
    async with get_session().create_client("s3", **moto.client_kwargs()) as client:
        yield client


@pytest.fixture
async def s3_tiers(moto, bucket):
    """make(cls, start=True, **options): a tier of `cls` on the moto endpoint and the test's
    bucket (options override both); every tier made is closed when the test ends."""
    tiers = []

    async def make(cls, start: bool = True, **options):
        tier = cls("s3", **{**moto.tier_kwargs(), "bucket": bucket, "timeout_s": 5.0, **options})
        tiers.append(tier)
        if start:
            await tier.start()
        return tier

    yield make
    for tier in tiers:
        await tier.close()
