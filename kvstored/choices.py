# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Enums of option values whose error for a bad value lists the valid ones."""

from __future__ import annotations

import enum
from typing import Any


class Choice(enum.Enum):
    """An option's values (`WritePolicy("write-back")`); `WritePolicy("bogus")` raises a ValueError
    naming every valid value, which the config error passes on to the user."""

    @classmethod
    def _missing_(cls, value: Any) -> Choice:
        raise ValueError(f"{value!r} is not one of {', '.join(str(m.value) for m in cls)}")
