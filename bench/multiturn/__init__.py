# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Multi-turn benchmark of kvstored (not a test): the article's workload against the real daemon,
with the GPU modelled. Workload: multi-turn conversations with a 12K-token first prompt and 4K more
tokens per turn, 8 turns, 20 s think time, at 16 to 256 simultaneous conversations. Compared: no
offload, RAM tier, RAM + fs, RAM + fs + S3, by modelled throughput and hit rate of reusable tokens.
Modelled: Qwen3.6-35B-A3B on 2x H100 (TP=2) by default, Llama-3.1-8B on one H100 with --model.

Run as `python -m bench.multiturn`; --nodes N: bench/multiturn/nodes.py. Modules: model (presets, workload,
derived figures), sim (the model clock), offload (a real daemon as the offload target), runs (one run),
limits, report, plan (the sweep, and what one node does where several differ: nodes_main), cli.
Method and results: docs/benchmarks.md.
"""
