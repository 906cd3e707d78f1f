# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Only the C helpers live here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvstored.shm._safecopy", ["kvstored/shm/_safecopy.c"], optional=True),
        Extension("kvstored.peer._rxframe", ["kvstored/peer/_rxframe.c"], optional=True),
    ]
)
