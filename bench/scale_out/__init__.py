# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Scale-out on paper (issue #11 part 9; not a test): what the peer tier's remote-location index costs
each node from 1 to 1000 nodes (and on to --max-nodes), for a stated fleet workload, with the
daemon's own per-operation costs measured by bench/scale_calibrate (default: the committed
docs/scale-out-calibration.json), for four designs: mesh (as built), coalesced mesh, directory
(rendezvous-hashed shards) and router (llm-d consuming KV events). A design stops scaling at the
first node count where its upkeep CPU exceeds --cpu-budget of one core or its memory exceeds
--memory-budget-gib.

Modules: fleet (workload, budget, costs, rates), designs, report, cli.
Method, the designs in full, baselines, targets and results: docs/benchmarks.md.
"""
