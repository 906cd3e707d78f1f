# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Benchmark of kvstored's local data path (not a test): store and load of a working set (1 GiB of
2 MiB chunks) through pool mapping and through region registration, with 1 and 2 client
processes, beside a numpy memcpy of the same bytes; lookup latency of 1 and 256 keys beside an
empty gRPC round trip. Every baseline is measured in the same run.

Method, baselines, targets and results: docs/benchmarks.md.
"""
