# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Per-operation costs of the peer tier, measured on real daemons: the calibration bench/scale_out models
1 to 1000 nodes with (issue #11 part 9; not a test). Method and results: docs/scale-out.md."""
