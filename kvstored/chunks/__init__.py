# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""What a chunk is, wherever it lives: its id and kind types (ids.py), its file format with header
and checksum (chunkfile.py), and the page-aligned views its bytes move through (views.py)."""
