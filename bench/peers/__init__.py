# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The systems bench.compare puts side by side: for each, how its server starts (in a venv of its
own for the peers) and a driver that bench.peers.worker runs in client processes. Everything
imported at the top of these modules is stdlib or numpy, so the worker runs in any venv."""
