# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The fleet measured (issue #21 part 4; not a test): N real daemons in network namespaces under the same
load per node, mesh against fleet directory. Modules: run (one set-up at one N), cli (the sweep, the
table); the chart: bench.plot's plot_fleet. Method and results: docs/benchmarks.md ("The fleet,
measured"), docs/scale-out.md."""
