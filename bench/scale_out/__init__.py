# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Scale-out on paper (issue #11 part 9; not a test): what each of five designs costs a node from 1 to 1000
nodes, from the daemon's costs measured by bench/scale_calibrate. Modules: fleet (workload, budget, costs,
rates), designs, report, cli. Method and results: docs/scale-out.md, docs/benchmarks.md."""
