# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""kvstored: a per-node KV-cache store for LLM inference engines."""

__version__ = "0.1.0"
