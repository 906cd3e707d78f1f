# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The filesystem tier: bookkeeping on the event loop (tier.py), blocking job bodies on its I/O
threads (jobs.py), the syscalls they use (io.py), namespace records (records.py)."""
