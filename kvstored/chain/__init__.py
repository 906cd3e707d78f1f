# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The tier chain: where a chunk goes between RAM and the tiers below.

chain.py (TierChain: lookups, stores, loads, deletes), leases.py (the one leasing primitive every
reader goes through), writeback.py (chunks leaving RAM go down first), promotion.py (chunks
coming up, and the deletes they must not undo), region_load.py and staged.py (region loads past
a full RAM, through staging), room.py, start_by.py, region_copy.py (what those share),
lower.py (a tier as the chain drives it), factory.py (the tiers from config), stats.py (what
Stats and /metrics read).
"""
