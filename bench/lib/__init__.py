# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What the benchmarks share: daemons, S3 servers, the physical limits of the machine, reports."""
