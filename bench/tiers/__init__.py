# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Benchmark of kvstored's secondary tiers against the raw I/O beneath them (not a test): the fs
tier beside raw O_DIRECT pwritev/preadv of the same bytes (cold reads: page cache dropped), and
the S3 tier beside raw aiobotocore put/get of the same objects (radosgw or moto), in one run.

Method, baselines, targets and results: docs/benchmarks.md.
"""
